"""The proxy's `slo.firstTokenTimeoutMs` and `slo.streamStallTimeoutMs`, against a raw upstream on loopback.

The upstream is a few lines of asyncio (the fake engine always sends its response head at once, and a
silent server is the point here). It records each connection and when the proxy closed it: a timeout
must drop the upstream connection, since that is how the engine learns to abort the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from decodeservice.proxy.errors import PolicyError
from decodeservice.proxy.policy import Policy
from tests.proxy.conftest import running_proxy

SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
TOKEN = b'data: {"choices": [{"index": 0, "text": "tok", "finish_reason": null}]}\n\n'
BODY = {"prompt": "x", "max_tokens": 4, "stream": True}


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


@dataclasses.dataclass
class RawUpstream:
    """`mode`: silent (reads the request, never answers), head (SSE head, then nothing), stall (head and one
    token, then nothing), gaps (head, then `tokens` tokens `gap_s` apart, then [DONE])."""

    mode: str
    gap_s: float = 0.0
    tokens: int = 3
    url: str = ""
    requests: int = 0
    closed: int = 0  # connections the proxy closed while the answer was unfinished
    closed_event: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = re.search(rb"content-length: *(\d+)", head, re.IGNORECASE)
            await reader.readexactly(int(length[1]) if length else 0)
            if not head.startswith(b"POST /v1/"):  # the proxy's /metrics relays the engine's: none here
                writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                return
            self.requests += 1
            if self.mode != "silent":
                writer.write(SSE_HEAD)
            if self.mode == "stall":
                writer.write(_chunk(TOKEN))
            if self.mode == "bulk":  # more than the socket buffers hold, at once
                writer.write(_chunk(TOKEN * self.tokens) + _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
                await writer.drain()
                return
            if self.mode == "gaps":
                for _ in range(self.tokens):
                    await asyncio.sleep(self.gap_s)  # the upstream's pacing, below the proxy's stall limit
                    writer.write(_chunk(TOKEN))
                writer.write(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
                return
            await writer.drain()
            if await reader.read() == b"":  # EOF: the proxy gave up on this request and closed it
                self.closed += 1
                self.closed_event.set()
        finally:
            writer.close()


@contextlib.asynccontextmanager
async def raw_upstream(mode: str, **kwargs: Any) -> AsyncIterator[RawUpstream]:
    upstream = RawUpstream(mode, **kwargs)
    handlers: set[asyncio.Task[None]] = set()

    def connected(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.create_task(upstream.handle(reader, writer))
        handlers.add(task)
        task.add_done_callback(handlers.discard)

    server = await asyncio.start_server(connected, "127.0.0.1", 0)
    upstream.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        yield upstream
    finally:
        server.close()
        for task in list(handlers):
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
        await server.wait_closed()


def _policy(first_token_ms: float | None = 200, stall_ms: float | None = 200) -> dict[str, Any]:
    return {"slo": {"firstTokenTimeoutMs": first_token_ms, "streamStallTimeoutMs": stall_ms}}


async def _timeouts_counted(client: httpx.AsyncClient, kind: str) -> float:
    text = (await client.get("/metrics")).text
    found = re.search(rf'^decode_proxy:upstream_errors_total\{{kind="{kind}"\}} (\S+)$', text, re.MULTILINE)
    return float(found[1]) if found else 0.0


def _events(text: str) -> list[Any]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


@pytest.mark.parametrize("stream", [False, True])
async def test_no_response_head_in_time_is_a_504_and_the_upstream_is_closed(stream: bool) -> None:
    async with raw_upstream("silent") as up, running_proxy(_policy(), up.url) as (_, client):
        response = await client.post("/v1/completions", json={**BODY, "stream": stream})
        assert response.status_code == 504
        assert response.json()["error"] == {
            "message": "no first token from the upstream engine within slo.firstTokenTimeoutMs (200 ms)",
            "type": "server_error", "param": None, "code": "first_token_timeout"}
        await asyncio.wait_for(up.closed_event.wait(), 5)
        assert up.closed == up.requests == 1
        assert await _timeouts_counted(client, "first_token_timeout") == 1
        assert '{class="interactive",status="504"}' in (await client.get("/metrics")).text


async def test_a_head_without_a_first_token_ends_in_an_sse_error_event() -> None:
    async with raw_upstream("head") as up, running_proxy(_policy(stall_ms=None), up.url) as (_, client):
        response = await client.post("/v1/completions", json=BODY)
        assert response.status_code == 200
        assert _events(response.text) == [{"error": {
            "message": "no first token from the upstream engine within slo.firstTokenTimeoutMs (200 ms)",
            "type": "server_error", "param": None, "code": "first_token_timeout"}}]
        await asyncio.wait_for(up.closed_event.wait(), 5)
        assert up.closed == 1
        assert await _timeouts_counted(client, "first_token_timeout") == 1


async def test_a_stream_that_stalls_ends_in_an_sse_error_event_and_the_upstream_is_closed() -> None:
    async with raw_upstream("stall") as up, running_proxy(_policy(first_token_ms=None), up.url) as (_, client):
        response = await client.post("/v1/completions", json=BODY)
        assert response.status_code == 200
        events = _events(response.text)
        assert events[0]["choices"][0]["text"] == "tok"  # the token that came is relayed first
        assert events[1:] == [{"error": {
            "message": "the upstream engine sent nothing for slo.streamStallTimeoutMs (200 ms)",
            "type": "server_error", "param": None, "code": "stall_timeout"}}]
        await asyncio.wait_for(up.closed_event.wait(), 5)
        assert up.closed == 1
        assert await _timeouts_counted(client, "stall_timeout") == 1
        assert await _timeouts_counted(client, "first_token_timeout") == 0


async def test_gaps_below_the_limits_pass() -> None:
    # Gaps 5x below the stall limit (a loaded machine's hiccups cannot trip it), the whole stream twice
    # as long: the limit is per gap, not per stream.
    async with raw_upstream("gaps", gap_s=0.08, tokens=10) as up, \
            running_proxy(_policy(first_token_ms=1000, stall_ms=400), up.url) as (_, client):
        response = await client.post("/v1/completions", json=BODY)
        assert response.status_code == 200
        assert [e["choices"][0]["text"] for e in _events(response.text)] == ["tok"] * 10
        assert response.text.endswith("data: [DONE]\n\n")
        assert up.closed == 0
        for kind in ("first_token_timeout", "stall_timeout"):
            assert await _timeouts_counted(client, kind) == 0


async def test_a_client_that_reads_slowly_is_not_an_upstream_stall() -> None:
    # The upstream sends everything at once; the client stops reading for 2.5x the stall limit, so the
    # proxy waits on the client, not on the upstream, and the answer must still be whole.
    tokens = 400_000  # ~28 MB: more than the loopback socket buffers hold, so the proxy's writes block
    async with raw_upstream("bulk", tokens=tokens) as up, \
            running_proxy(_policy(first_token_ms=5000, stall_ms=200), up.url) as (_, client):
        # (The first-token limit is not what this tests: at 200 ms a loaded machine tripped it.)
        async with client.stream("POST", "/v1/completions", json=BODY) as response:
            received = bytearray()
            async for chunk in response.aiter_raw():
                if not received:
                    await asyncio.sleep(0.5)  # the slow reader
                received += chunk
        assert received.count(b'"text": "tok"') == tokens and received.endswith(b"data: [DONE]\n\n")
        assert await _timeouts_counted(client, "stall_timeout") == 0


async def test_null_turns_the_limits_off() -> None:
    # The same silent upstream that gets a 504 after 200 ms above: with the limits off, a client waiting
    # 2.5x as long still has no answer, and nothing was counted or closed.
    async with raw_upstream("silent") as up, running_proxy(_policy(None, None), up.url) as (_, client):
        with pytest.raises(httpx.ReadTimeout):
            await client.post("/v1/completions", json=BODY, timeout=httpx.Timeout(10.0, read=0.5))
        assert await _timeouts_counted(client, "first_token_timeout") == 0
        assert up.requests == 1 and up.closed == 0


def test_policy_defaults_and_validation() -> None:
    slo = Policy().slo
    assert (slo.first_token_timeout_ms, slo.stream_stall_timeout_ms) == (60_000, 30_000)
    assert Policy.from_mapping(_policy(None, None)).slo.first_token_timeout_ms is None
    for bad in (0, -1, "soon"):
        with pytest.raises(PolicyError, match="slo.firstTokenTimeoutMs"):
            Policy.from_mapping({"slo": {"firstTokenTimeoutMs": bad}})
        with pytest.raises(PolicyError, match="slo.streamStallTimeoutMs"):
            Policy.from_mapping({"slo": {"streamStallTimeoutMs": bad}})
