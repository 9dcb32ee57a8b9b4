"""A small fake OpenAI-compatible engine, for the proxy's tests and its overhead benchmark.

It is a real Starlette app served by uvicorn on loopback. It streams `max_tokens` tokens (SSE) with a
configurable time to first token and inter-token latency, and can be told to fail with a status, to
die mid-stream (the connection breaks without a terminating chunk), or to report itself unready. It
records the bodies it received and which streams were cancelled by their client.

    python -m decodeservice.bench.fake_engine --port 8001 --ttft-ms 20 --itl-ms 10
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import socket
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp

MODEL = "fake-model"


class EngineCrash(RuntimeError):
    """Raised inside a stream to make uvicorn drop the connection mid-body."""


@dataclasses.dataclass(kw_only=True)
class FakeEngine:
    """Behaviour knobs (tests change them between requests) and what the engine observed."""

    url: str = ""  # set by whoever serves it
    ttft_s: float = 0.0
    itl_s: float = 0.0
    default_tokens: int = 16
    ready: bool = True
    fail_status: int | None = None  # answer every completion with this status
    die_after_tokens: int | None = None  # break the connection after this many tokens
    received: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    started: int = 0
    completed: int = 0
    cancelled: int = 0
    active: int = 0  # streams being generated right now
    max_active: int = 0
    start_times: list[float] = dataclasses.field(default_factory=list)

    def app(self) -> Starlette:
        return Starlette(routes=[
            Route("/v1/completions", self._completions, methods=["POST"]),
            Route("/v1/chat/completions", self._chat, methods=["POST"]),
            Route("/v1/models", self._models, methods=["GET"]),
            Route("/tokenize", self._tokenize, methods=["POST"]),
            Route("/health", self._health, methods=["GET"]),
            Route("/ready", self._ready, methods=["GET"]),
            Route("/metrics", self._metrics, methods=["GET"]),
        ])

    async def wait_for(self, predicate: Callable[[FakeEngine], bool], *, timeout: float = 5.0) -> None:
        """Wait (bounded) until `predicate(self)` holds; polls since the state changes in other tasks."""
        deadline = time.monotonic() + timeout
        while not predicate(self):
            if time.monotonic() > deadline:
                raise TimeoutError(f"fake engine condition not met within {timeout} s: {self}")
            await asyncio.sleep(0.005)

    async def _completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def _chat(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, *, chat: bool) -> Response:
        body = await request.json()
        self.received.append(body)
        if self.fail_status is not None:
            return JSONResponse({"error": {"message": "injected failure", "type": "server_error", "param": None,
                                           "code": None}}, status_code=self.fail_status)
        n = body.get("max_completion_tokens") or body.get("max_tokens") or self.default_tokens
        if body.get("stream"):
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(self._stream(n, chat=chat, usage=usage), media_type="text/event-stream")
        await asyncio.sleep(self.ttft_s + self.itl_s * max(0, n - 1))
        text = "".join(f" t{i}" for i in range(n))
        choice: dict[str, Any] = (
            {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"} if chat
            else {"index": 0, "text": text, "finish_reason": "length"}
        )
        return JSONResponse({"id": "cmpl-fake", "object": "chat.completion" if chat else "text_completion",
                             "model": MODEL, "choices": [choice],
                             "usage": {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}})

    async def _stream(self, n: int, *, chat: bool, usage: bool) -> AsyncIterator[bytes]:
        self.started += 1
        self.start_times.append(time.perf_counter())
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            if chat:
                yield _sse(_chat_chunk({"role": "assistant", "content": ""}, None))
            await asyncio.sleep(self.ttft_s)
            for i in range(n):
                if i:
                    await asyncio.sleep(self.itl_s)
                if self.die_after_tokens is not None and i >= self.die_after_tokens:
                    raise EngineCrash("injected mid-stream death")
                finish = "length" if i == n - 1 else None
                yield _sse(_chat_chunk({"content": f" t{i}"}, finish) if chat else _text_chunk(f" t{i}", finish))
            if usage:
                yield _sse({"id": "cmpl-fake", "object": "chat.completion.chunk" if chat else "text_completion",
                            "model": MODEL, "choices": [],
                            "usage": {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}})
            yield b"data: [DONE]\n\n"
            self.completed += 1
        except asyncio.CancelledError:
            self.cancelled += 1  # the client (the proxy) closed the connection mid-stream
            raise
        finally:
            self.active -= 1

    async def _models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "fake"}]})

    async def _tokenize(self, request: Request) -> Response:
        body = await request.json()
        if "messages" in body:
            text = " ".join(str(m.get("content", "")) for m in body["messages"])
        else:
            text = str(body.get("prompt", ""))
        count = len(text.split())  # one token per word keeps the tests' arithmetic obvious
        return JSONResponse({"count": count, "tokens": list(range(count)), "max_model_len": 4096})

    async def _health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def _ready(self, request: Request) -> Response:
        return JSONResponse({"ready": self.ready}, status_code=200 if self.ready else 503)

    async def _metrics(self, request: Request) -> Response:
        return PlainTextResponse(f"fake_engine_requests_started {self.started}\n")


def _sse(event: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(event).encode() + b"\n\n"


def _text_chunk(text: str, finish: str | None) -> dict[str, Any]:
    return {"id": "cmpl-fake", "object": "text_completion", "model": MODEL,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}


def _chat_chunk(delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
    return {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "model": MODEL,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


@contextlib.asynccontextmanager
async def serve_loopback(app: ASGIApp, *, startup_timeout: float = 10.0) -> AsyncIterator[str]:
    """Serve an ASGI app with uvicorn on 127.0.0.1 (ephemeral port) in this loop; yields its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="critical", access_log=False, lifespan="on",
                            timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        deadline = time.monotonic() + startup_timeout
        while not server.started:
            if task.done():
                task.result()
            if time.monotonic() > deadline:
                raise TimeoutError("uvicorn did not start")
            await asyncio.sleep(0.005)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task
        sock.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--ttft-ms", type=float, default=20.0)
    parser.add_argument("--itl-ms", type=float, default=10.0)
    parser.add_argument("--tokens", type=int, default=64, help="tokens when the request sets no max_tokens")
    args = parser.parse_args()
    engine = FakeEngine(ttft_s=args.ttft_ms / 1000.0, itl_s=args.itl_ms / 1000.0, default_tokens=args.tokens)
    uvicorn.run(engine.app(), host=args.host, port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
