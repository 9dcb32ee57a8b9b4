"""Faults: an endpoint that dies before answering loses no request; a router that dies mid-stream
leaves its client a clean error, not a truncated success."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator

import httpx
import pytest

from tests.router.conftest import chat, fake_engines, metric, running_router
from tests.router.test_hold import router_process

DOC = "Each conversation opens with its own document. " * 50


@contextlib.asynccontextmanager
async def dying_endpoint() -> AsyncIterator[tuple[str, list[int]]]:
    """A 'pod' whose proxy says it is ready but whose process dies on every completion request: the
    connection closes before any response byte. Yields its URL and a count of requests it took."""
    taken = [0]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        if head.startswith(b"POST"):
            taken[0] += 1
        else:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 0\r\n\r\n")
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", taken
    finally:
        server.close()
        await server.wait_closed()


async def test_a_request_whose_endpoint_dies_before_answering_is_retried_elsewhere() -> None:
    async with fake_engines(1) as (good,), dying_endpoint() as (dying, taken), \
            running_router([dying, good.url]) as (app, client):
        bodies = [chat(f"conversation {n}: " + DOC) for n in range(8)]
        responses = await asyncio.gather(*(client.post("/v1/chat/completions", json=b) for b in bodies))
        assert [r.status_code for r in responses] == [200] * 8
        assert all(r.content.endswith(b"data: [DONE]\n\n") for r in responses)
        assert taken[0] >= 1  # some were sent to the dying endpoint first
        assert sorted(map(str, good.received)) == sorted(map(str, bodies))
        text = (await client.get("/metrics")).text
        assert metric(text, "decode_router:requests_total", status="200") == 8


async def test_a_router_killed_mid_stream_ends_the_clients_stream_with_an_error() -> None:
    async with fake_engines(1, itl_s=0.02, default_tokens=10_000) as (engine,):
        async with router_process("--endpoints", engine.url, "--scrape-interval-seconds", "0.1") as (router, proc):
            async with httpx.AsyncClient(base_url=router, timeout=30.0) as client:
                while not metric((await client.get("/metrics")).text, "decode_router:endpoints", state="ready"):
                    await asyncio.sleep(0.05)
                lines: list[str] = []
                with pytest.raises(httpx.HTTPError):
                    async with client.stream("POST", "/v1/chat/completions", json=chat("go", max_tokens=10_000)) as r:
                        assert r.status_code == 200
                        async for line in r.aiter_lines():
                            lines.append(line)
                            if len(lines) == 6:
                                proc.send_signal(signal.SIGKILL)
                assert lines and "data: [DONE]" not in lines
                await engine.wait_for(lambda e: e.cancelled == 1)  # and the engine stopped generating
