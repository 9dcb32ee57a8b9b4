"""The upstream's httpx transport: HTTP/1.1 parsed by httptools (llhttp) in an asyncio protocol, and a
LIFO keep-alive pool.

Why not httpx's default transport (httpcore): its pool walks every connection it holds each time a
request starts or a response closes, and each body chunk climbs through anyio and several wrapper
layers. With hundreds of concurrent streams of small SSE chunks that bookkeeping cost the proxy more
CPU than relaying the bytes. An h11 + StreamReader version of this file was the next step; h11's
pure-Python state machine then cost more per chunk than the rest of the relay (cProfile under
benchmarks/proxy_overhead.py). Here the bytes are parsed in C as the event loop hands them over
(`http1.py`), body chunks wait in a queue, and a consumer that fell behind gets everything queued as
one chunk: fewer, larger writes exactly when the proxy is busiest.

What it does not do, because the upstream is an engine next to the proxy: HTTP/2, proxies, retries.
TLS works (the system's default context); no cap on open connections, since admission's `maxInflight`
already bounds them. httpx stays the client API: redirects, headers, timeouts and the exceptions
callers catch are httpx's.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import time
from collections.abc import AsyncIterator

import httpx

from decodeservice.proxy.http1 import Connection, send_request

Origin = tuple[bytes, bytes, int]  # scheme, host, port
_DEFAULT_PORTS = {b"http": 80, b"https": 443}


class UpstreamTransport(httpx.AsyncBaseTransport):
    """Connections per origin; idle ones are reused newest first and dropped after `keepalive_expiry`.

    `keepalive_expiry` stays below the 5 s uvicorn (and vLLM) keep idle connections open, so the proxy
    drops a connection before the server would close it under a request.
    """

    def __init__(self, *, max_idle_per_origin: int = 64, keepalive_expiry: float = 4.0) -> None:
        if max_idle_per_origin < 0 or keepalive_expiry < 0:
            raise ValueError("max_idle_per_origin and keepalive_expiry must be >= 0")
        self.max_idle_per_origin = max_idle_per_origin
        self.keepalive_expiry = keepalive_expiry
        self._idle: dict[Origin, collections.deque[Connection]] = {}
        self._ssl: ssl.SSLContext | None = None
        self._closed = False

    def idle_connections(self) -> int:
        return sum(len(idle) for idle in self._idle.values())

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self._closed:
            raise RuntimeError("the upstream transport is closed")
        url = request.url
        scheme = url.raw_scheme
        if scheme not in _DEFAULT_PORTS:
            raise httpx.UnsupportedProtocol(f"unsupported URL scheme {url.scheme!r}", request=request)
        origin = (scheme, url.raw_host, url.port or _DEFAULT_PORTS[scheme])
        timeouts = request.extensions.get("timeout", {})
        conn = self._checkout(origin) or await self._connect(origin, timeouts.get("connect"), request)
        try:
            conn.begin(head_only=request.method == "HEAD")
            await send_request(conn, request, timeouts.get("write"))
            read_timeout = timeouts.get("read")
            while not conn.head_done:
                _raise_if_failed(conn, request)
                await conn.wait(read_timeout)
        except TimeoutError:
            conn.close()
            raise httpx.ReadTimeout("waiting for the upstream's response timed out", request=request) from None
        except BaseException:
            conn.close()  # cancelled or failed half-way: the connection's state is unknown
            raise
        return httpx.Response(
            status_code=conn.status,
            headers=conn.headers,
            stream=_ResponseStream(self, origin, conn, timeouts.get("read"), request),
            extensions={"http_version": conn.http_version, "reason_phrase": conn.reason},
        )

    async def aclose(self) -> None:
        self._closed = True
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()

    def _checkout(self, origin: Origin) -> Connection | None:
        idle = self._idle.get(origin)
        while idle:
            conn = idle.pop()  # newest first: the likeliest to be alive, and the oldest can expire
            if conn.still_open() and time.monotonic() - conn.idle_since < self.keepalive_expiry:
                return conn
            conn.close()
        return None

    def _release(self, origin: Origin, conn: Connection) -> None:
        idle = self._idle.setdefault(origin, collections.deque())
        now = time.monotonic()
        while idle and now - idle[0].idle_since >= self.keepalive_expiry:
            idle.popleft().close()  # expired at the cold end: close them rather than hold the sockets
        if self._closed or len(idle) >= self.max_idle_per_origin:
            conn.close()
            return
        conn.idle_since = now
        idle.append(conn)

    async def _connect(self, origin: Origin, timeout: float | None, request: httpx.Request) -> Connection:
        scheme, host, port = origin
        tls = self._ssl_context() if scheme == b"https" else None
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):
                _, conn = await loop.create_connection(Connection, host.decode("ascii"), port, ssl=tls)
        except TimeoutError:
            raise httpx.ConnectTimeout(f"connecting to {request.url.host}:{port} timed out",
                                       request=request) from None
        except OSError as exc:
            raise httpx.ConnectError(str(exc), request=request) from exc
        return conn

    def _ssl_context(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = ssl.create_default_context()  # built on first use: loading the CAs is slow, and plain-HTTP upstreams never need them
        return self._ssl


def _raise_if_failed(conn: Connection, request: httpx.Request) -> None:
    if conn.error is not None:
        raise httpx.RemoteProtocolError(conn.error, request=request)
    if conn.lost:
        raise httpx.ReadError("the connection to the upstream was lost", request=request)


class _ResponseStream(httpx.AsyncByteStream):
    def __init__(self, transport: UpstreamTransport, origin: Origin, conn: Connection, read_timeout: float | None,
                 request: httpx.Request) -> None:
        self._transport = transport
        self._origin = origin
        self._conn: Connection | None = conn
        self._read_timeout = read_timeout
        self._request = request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        conn = self._conn
        if conn is None:
            raise httpx.StreamClosed()
        while True:
            if conn.chunks:
                yield conn.take_body()  # everything that arrived since the last chunk, in one piece
            elif conn.complete:
                return
            else:
                _raise_if_failed(conn, self._request)
                try:
                    await conn.wait(self._read_timeout)
                except TimeoutError:
                    raise httpx.ReadTimeout("reading from the upstream timed out", request=self._request) from None

    async def aclose(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if conn.complete and conn.keep_alive and not conn.lost and not conn.chunks:
            self._transport._release(self._origin, conn)
        else:
            conn.close()  # cut short (or `Connection: close`): never reuse a half-read connection
