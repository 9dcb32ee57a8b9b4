"""The upstream transport against real loopback servers: reuse, failures, cancellation, timeouts.

Each test runs on asyncio's loop and on uvloop (see conftest.py), since `decodectl proxy` runs on uvloop.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from decodeservice.proxy.transport import UpstreamTransport
from tests.support.fake_engine import FakeEngine, serve_loopback

STREAM = {"model": "m", "prompt": "x", "max_tokens": 50, "stream": True}


@contextlib.asynccontextmanager
async def client_for(*, max_idle: int = 8, read: float | None = 5.0,
                     ) -> AsyncIterator[tuple[httpx.AsyncClient, UpstreamTransport]]:
    transport = UpstreamTransport(max_idle_per_origin=max_idle)
    async with httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(5.0, read=read)) as client:
        yield client, transport


async def _echo(request: Request) -> Response:
    body = await request.body()
    assert request.client is not None
    return JSONResponse({"port": request.client.port, "body": body.decode(), "query": request.url.query,
                         "method": request.method})


@pytest.fixture
async def echo_url() -> AsyncIterator[str]:
    app = Starlette(routes=[Route("/echo", _echo, methods=["GET", "POST", "PUT"])])
    async with serve_loopback(app) as url:
        yield url


async def test_keep_alive_connection_is_reused(echo_url: str) -> None:
    async with client_for() as (client, transport):
        first = (await client.get(echo_url + "/echo")).json()
        assert transport.idle_connections() == 1
        second = (await client.post(echo_url + "/echo?a=1&b=2", content=b"hello")).json()
    assert first["port"] == second["port"]
    assert second == {"port": first["port"], "body": "hello", "query": "a=1&b=2", "method": "POST"}


async def test_streamed_request_body_arrives_whole(echo_url: str) -> None:
    async def parts() -> AsyncIterator[bytes]:
        for part in (b"a" * 70_000, b"", b"b" * 3):
            yield part

    async with client_for() as (client, _):
        r = await client.put(echo_url + "/echo", content=parts())
    assert r.json()["body"] == "a" * 70_000 + "bbb"


async def test_idle_pool_is_bounded_and_concurrent_requests_get_their_own(engine: FakeEngine) -> None:
    engine.itl_s = 0.01
    async with client_for(max_idle=2) as (client, transport):

        async def one() -> int:
            async with client.stream("POST", engine.url + "/v1/completions", json=STREAM) as r:
                return len([chunk async for chunk in r.aiter_raw()])

        await asyncio.gather(*(one() for _ in range(4)))
        assert engine.max_active == 4  # four connections streamed at once
        assert transport.idle_connections() == 2


async def test_connection_refused_is_a_connect_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connections are refused
        async with client_for() as (client, _):
            with pytest.raises(httpx.ConnectError):
                await client.get(f"http://127.0.0.1:{port}/ready")


async def test_upstream_dying_mid_body_raises_and_drops_the_connection(engine: FakeEngine) -> None:
    engine.die_after_tokens = 3
    async with client_for() as (client, transport):
        chunks: list[bytes] = []
        with pytest.raises(httpx.RemoteProtocolError):
            async with client.stream("POST", engine.url + "/v1/completions", json=STREAM) as r:
                async for chunk in r.aiter_raw():
                    chunks.append(chunk)
        assert b" t2" in b"".join(chunks)
        assert transport.idle_connections() == 0


async def test_closing_a_response_early_closes_the_upstream_socket(engine: FakeEngine) -> None:
    engine.itl_s = 0.02
    async with client_for() as (client, transport):
        async with client.stream("POST", engine.url + "/v1/completions", json={**STREAM, "max_tokens": 2000}) as r:
            async for chunk in r.aiter_raw():
                if b" t1" in chunk:
                    break
        await engine.wait_for(lambda e: e.cancelled == 1)  # the engine saw the disconnect and aborted
        assert transport.idle_connections() == 0


async def test_read_timeout(engine: FakeEngine) -> None:
    engine.ttft_s = 2.0
    async with client_for(read=0.05) as (client, transport):
        with pytest.raises(httpx.ReadTimeout):
            async with client.stream("POST", engine.url + "/v1/completions", json=STREAM) as r:
                await r.aread()
        await engine.wait_for(lambda e: e.cancelled == 1)
        assert transport.idle_connections() == 0


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def raw_server(handler: Handler) -> AsyncIterator[tuple[str, list[int]]]:
    """A hand-written HTTP/1.1 server; yields its URL and a list counting the connections it accepted."""
    accepted: list[int] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        try:
            await handler(reader, writer)
        finally:
            writer.close()
            await writer.wait_closed()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        yield f"http://127.0.0.1:{port}", accepted


async def test_a_connection_the_server_closed_while_idle_is_not_reused() -> None:
    closed = asyncio.Event()

    async def answer_once_then_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")  # keep-alive, then closed anyway
        await writer.drain()
        writer.close()
        await writer.wait_closed()
        closed.set()

    async with raw_server(answer_once_then_close) as (url, accepted), client_for() as (client, transport):
        assert (await client.get(url + "/")).text == "ok"
        assert transport.idle_connections() == 1
        await closed.wait()
        closed.clear()
        assert (await client.get(url + "/")).text == "ok"  # a new connection, no error
        assert len(accepted) == 2


async def test_connection_close_and_informational_responses() -> None:
    async def continue_then_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n"
                     b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 5\r\n\r\nhello")
        await writer.drain()

    async with raw_server(continue_then_close) as (url, accepted), client_for() as (client, transport):
        r = await client.get(url + "/")
        assert (r.status_code, r.text, r.http_version) == (200, "hello", "HTTP/1.1")
        assert transport.idle_connections() == 0  # the server said it closes: never reused
        assert (await client.get(url + "/")).text == "hello"
        assert len(accepted) == 2


async def test_server_closing_before_answering_is_a_protocol_error() -> None:
    async def close_at_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")

    async with raw_server(close_at_once) as (url, _), client_for() as (client, _):
        with pytest.raises(httpx.RemoteProtocolError):
            await client.get(url + "/")


async def test_a_protocol_switch_is_refused_not_waited_on() -> None:
    async def switch(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\n")
        await writer.drain()
        await reader.read()  # hold the connection open: a client that waited here would hang

    async with raw_server(switch) as (url, _), client_for() as (client, _):
        with pytest.raises(httpx.RemoteProtocolError):
            await client.get(url + "/", headers={"upgrade": "websocket", "connection": "upgrade"})


async def test_a_head_response_ends_at_its_headers() -> None:
    async def head(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n")  # the length a GET would have
        await writer.drain()
        await reader.read()

    async with raw_server(head) as (url, _), client_for() as (client, transport):
        r = await asyncio.wait_for(client.head(url + "/"), timeout=2.0)
        assert (r.status_code, r.content, r.headers["content-length"]) == (200, b"", "1000")
        assert transport.idle_connections() == 0  # the parser still expects that body: never reused


async def test_a_body_without_length_runs_until_the_server_closes() -> None:
    async def http10(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.0 200 OK\r\ncontent-type: text/plain\r\n\r\nhello ")
        await writer.drain()
        writer.write(b"world")

    async with raw_server(http10) as (url, _), client_for() as (client, transport):
        r = await client.get(url + "/")
        assert (r.text, r.http_version) == ("hello world", "HTTP/1.0")
        assert transport.idle_connections() == 0


async def test_a_malformed_response_is_a_protocol_error() -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nbroken header line\r\n\r\nok")
        await writer.drain()
        await reader.read()

    async with raw_server(garbage) as (url, _), client_for() as (client, _):
        with pytest.raises(httpx.RemoteProtocolError):
            await client.get(url + "/")


async def test_header_injection_is_refused_before_anything_is_sent() -> None:
    received = bytearray()

    async def record(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        received.extend(await reader.read())

    async with raw_server(record) as (url, accepted), client_for() as (client, transport):
        with pytest.raises(httpx.LocalProtocolError):
            await client.get(url + "/", headers={"x-a": "b\r\nx-injected: 1"})
        with pytest.raises(httpx.LocalProtocolError):
            await client.get(url + "/", headers={"x-a: b": "c"})
        assert transport.idle_connections() == 0
    assert received == b""  # connections were opened (and dropped) but no byte was sent


async def test_a_slow_reader_pauses_the_upstream_and_loses_nothing() -> None:
    size = 32 * 1024 * 1024  # well beyond what loopback socket buffers hold
    wrote_all = asyncio.Event()

    async def big(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size)
        block = bytes(range(256)) * 4096  # 1 MiB
        for _ in range(size // len(block)):
            writer.write(block)
            await writer.drain()
        wrote_all.set()

    async with raw_server(big) as (url, _), client_for() as (client, _):
        async with client.stream("GET", url + "/") as r:
            chunks = r.aiter_raw()
            body = bytearray(await anext(chunks))
            await asyncio.sleep(0.3)
            assert not wrote_all.is_set()  # the transport stopped reading, so the server is held back
            async for chunk in chunks:
                body += chunk
        assert body == bytes(range(256)) * 4096 * 32
        assert wrote_all.is_set()
