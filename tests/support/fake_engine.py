"""The one fake OpenAI-compatible engine: for the proxy's and `decodectl bench`'s tests and the proxy
overhead benchmark. It is test support, not product: nothing under `decodeservice` imports it.

It is a real Starlette app served by uvicorn on loopback, in the caller's event loop
(`serve_loopback`) or as its own process (`python tests/support/fake_engine.py --ttft 0.15 --itl 0.04`
prints `PORT <n>` once it listens on 127.0.0.1, so its timing does not share the caller's loop). It
streams `max_tokens` tokens (SSE), `tokens_per_chunk` per chunk: the first chunk `ttft_s` after the
request, then one every `itl_s`. With `deadlines` (the process's default) chunk c is due at arrival +
ttft + c * itl, so a late wake-up is caught up and a client's measurements can be checked against the
exact truth; without, each chunk waits `itl_s` after the one before, as an engine's steps do (the
proxy overhead benchmark's pacing). It can be told to fail with a status, to die mid-stream (the connection breaks without a
terminating chunk), to report itself unready, to leave out the usage chunk or the model list. It
records the bodies it received (also at GET /debug/requests) and which streams were cancelled.
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
    tokens_per_chunk: int = 1
    deadlines: bool = False  # pace chunks against absolute deadlines from arrival (see the docstring)
    usage: bool = True  # send the usage chunk when the request asks for it (stream_options.include_usage)
    list_models: bool = True  # False: GET /v1/models is a 404, as on some servers
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
            *([Route("/v1/models", self._models, methods=["GET"])] if self.list_models else []),
            Route("/tokenize", self._tokenize, methods=["POST"]),
            Route("/health", self._health, methods=["GET"]),
            Route("/ready", self._ready, methods=["GET"]),
            Route("/metrics", self._metrics, methods=["GET"]),
            Route("/debug/requests", self._debug_requests, methods=["GET"]),
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
        arrived = time.perf_counter()
        body = await request.json()
        self.received.append(body)
        if self.fail_status is not None:
            return JSONResponse({"error": {"message": "injected failure", "type": "server_error", "param": None,
                                           "code": None}}, status_code=self.fail_status)
        n = body.get("max_completion_tokens") or body.get("max_tokens") or self.default_tokens
        if body.get("stream"):
            usage = self.usage and bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(self._stream(n, chat=chat, usage=usage, arrived=arrived),
                                     media_type="text/event-stream")
        await asyncio.sleep(self.ttft_s + self.itl_s * max(0, n - 1))
        text = "".join(f" t{i}" for i in range(n))
        choice: dict[str, Any] = (
            {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"} if chat
            else {"index": 0, "text": text, "finish_reason": "length"}
        )
        return JSONResponse({"id": "cmpl-fake", "object": "chat.completion" if chat else "text_completion",
                             "model": MODEL, "choices": [choice],
                             "usage": {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}})

    async def _stream(self, n: int, *, chat: bool, usage: bool, arrived: float) -> AsyncIterator[bytes]:
        self.started += 1
        self.start_times.append(time.perf_counter())
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            if chat:  # the role-only chunk, which a client must not count as the first token
                yield _sse(_chat_chunk({"role": "assistant", "content": ""}, None))
            k = self.tokens_per_chunk
            for c, first in enumerate(range(0, n, k)):
                if self.deadlines:
                    await asyncio.sleep(max(0.0, arrived + self.ttft_s + c * self.itl_s - time.perf_counter()))
                else:
                    await asyncio.sleep(self.itl_s if c else self.ttft_s)
                if self.die_after_tokens is not None and first >= self.die_after_tokens:
                    raise EngineCrash("injected mid-stream death")
                text = "".join(f" t{i}" for i in range(first, min(n, first + k)))
                finish = "length" if first + k >= n else None
                yield _sse(_chat_chunk({"content": text}, finish) if chat else _text_chunk(text, finish))
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
        messages = body.get("messages") if isinstance(body, dict) else None
        if not isinstance(body, dict) or ("messages" in body and not (
                isinstance(messages, list) and all(isinstance(m, dict) for m in messages))):
            # As the real engine: a malformed request is the client's 400, never a 500 of the server.
            return JSONResponse({"error": {"message": "malformed tokenize request", "type": "invalid_request_error",
                                           "param": "messages", "code": "invalid_field"}}, status_code=400)
        if messages is not None:
            text = " ".join(str(m.get("content", "")) for m in messages)
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

    async def _debug_requests(self, request: Request) -> Response:
        return JSONResponse(self.received)


def _sse(event: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(event).encode() + b"\n\n"


def _text_chunk(text: str, finish: str | None) -> dict[str, Any]:
    return {"id": "cmpl-fake", "object": "text_completion", "model": MODEL,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}


def _chat_chunk(delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
    return {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "model": MODEL,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


@contextlib.asynccontextmanager
async def serve_loopback(app: ASGIApp, *, startup_timeout: float = 10.0,
                         sock: socket.socket | None = None) -> AsyncIterator[str]:
    """Serve an ASGI app with uvicorn on 127.0.0.1 (ephemeral port) in this loop; yields its base URL.

    `sock`: a socket already bound (not listening), to serve on a port chosen before, as a server that
    binds early and accepts only once it is up."""
    if sock is None:
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
    parser.add_argument("--port", type=int, default=0, help="on 127.0.0.1; 0 (default) picks a free one")
    parser.add_argument("--ttft", type=float, default=0.02, help="seconds to the first chunk")
    parser.add_argument("--itl", type=float, default=0.01, help="seconds between chunks")
    parser.add_argument("--tokens", type=int, default=64, help="tokens when the request sets no max_tokens")
    parser.add_argument("--tokens-per-chunk", type=int, default=1)
    parser.add_argument("--no-usage", action="store_true", help="never send the usage chunk")
    parser.add_argument("--no-models", action="store_true", help="no GET /v1/models (404), as on some servers")
    args = parser.parse_args()
    engine = FakeEngine(ttft_s=args.ttft, itl_s=args.itl, default_tokens=args.tokens,
                        tokens_per_chunk=args.tokens_per_chunk, deadlines=True, usage=not args.no_usage,
                        list_models=not args.no_models)
    sock = socket.socket()
    sock.bind(("127.0.0.1", args.port))
    engine.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    print(f"PORT {sock.getsockname()[1]}", flush=True)  # the stop word the caller waits for
    uvicorn.Server(uvicorn.Config(engine.app(), log_level="warning", access_log=False, lifespan="off")).run(
        sockets=[sock])


if __name__ == "__main__":
    main()
