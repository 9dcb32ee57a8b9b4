"""A fake OpenAI streaming server with exact, configurable timing; run as a subprocess by the tests.

`python fake_server.py --ttft 0.15 --itl 0.04 [--tokens-per-chunk K] [--no-usage]` prints `PORT <n>` once
it listens on 127.0.0.1. Each request streams `max_tokens` tokens: the first content chunk at TTFT after
the request arrived, then one chunk every ITL, each carrying K tokens. Chunks are scheduled against
absolute deadlines, so event-loop jitter does not accumulate. GET /debug/requests returns the bodies
received so far, so tests can check what the client sent.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route


def create_app(*, ttft: float, itl: float, tokens_per_chunk: int, usage: bool, list_models: bool) -> Starlette:
    received: list[dict[str, Any]] = []

    async def models(_: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def debug(_: Request) -> Response:
        return JSONResponse(received)

    async def complete(request: Request) -> Response:
        arrived = time.perf_counter()
        body = await request.json()
        received.append(body)
        chat = request.url.path.endswith("/chat/completions")
        n = int(body["max_tokens"])

        def chunk(text: str | None, extra: dict[str, Any] | None = None) -> str:
            if chat:
                choices = [{"index": 0, "delta": {"content": text} if text is not None else {"role": "assistant"}}]
            else:
                choices = [{"index": 0, "text": text or ""}]
            payload: dict[str, Any] = {"id": "x", "model": body["model"], "choices": choices}
            payload.update(extra or {})
            return f"data: {json.dumps(payload)}\n\n"

        async def events() -> AsyncIterator[str]:
            if chat:
                yield chunk(None)  # the role-only chunk must not count as the first token
            for i in range(math.ceil(n / tokens_per_chunk)):
                await asyncio.sleep(max(0.0, arrived + ttft + i * itl - time.perf_counter()))
                count = min(tokens_per_chunk, n - i * tokens_per_chunk)
                yield chunk(" tok" * count)
            if usage and (body.get("stream_options") or {}).get("include_usage"):
                yield f"data: {json.dumps({'id': 'x', 'choices': [], 'usage': {'prompt_tokens': 5, 'completion_tokens': n}})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[
        *([Route("/v1/models", models)] if list_models else []),
        Route("/debug/requests", debug),
        Route("/v1/completions", complete, methods=["POST"]),
        Route("/v1/chat/completions", complete, methods=["POST"]),
    ])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ttft", type=float, required=True)
    parser.add_argument("--itl", type=float, required=True)
    parser.add_argument("--tokens-per-chunk", type=int, default=1)
    parser.add_argument("--no-usage", action="store_true")
    parser.add_argument("--no-models", action="store_true", help="no GET /v1/models (404), as on some servers")
    args = parser.parse_args()
    app = create_app(ttft=args.ttft, itl=args.itl, tokens_per_chunk=args.tokens_per_chunk, usage=not args.no_usage,
                     list_models=not args.no_models)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    print(f"PORT {sock.getsockname()[1]}", flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off")).run(sockets=[sock])


if __name__ == "__main__":
    main()
