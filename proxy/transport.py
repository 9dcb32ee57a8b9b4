"""The upstream's httpx transport: HTTP/1.1 with h11 over asyncio streams, and a LIFO keep-alive pool.

Why not httpx's default transport (httpcore): its pool walks every connection it holds each time a
request starts or a response closes, and each body chunk climbs through anyio and several wrapper
layers. With hundreds of concurrent streams of small SSE chunks that bookkeeping cost the proxy more
CPU than relaying the bytes (cProfile under benchmarks/proxy_overhead.py). Here a request pops the most
recently used idle connection and a finished response pushes it back: no walk, and a chunk costs one
read, one h11 event and one yield.

What it does not do, because the upstream is an engine next to the proxy: HTTP/2, proxies, retries.
TLS works (the system's default context); no cap on open connections, since admission's `maxInflight`
already bounds them. httpx stays the client API: redirects, headers, timeouts and the exceptions
callers catch are httpx's.
"""

from __future__ import annotations

import asyncio
import collections
import select
import ssl
import time
from collections.abc import AsyncIterator

import h11
import httpx

Origin = tuple[bytes, bytes, int]  # scheme, host, port
_READ_SIZE = 64 * 1024
_DEFAULT_PORTS = {b"http": 80, b"https": 443}


class _Connection:
    __slots__ = ("h11", "idle_since", "reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.h11 = h11.Connection(h11.CLIENT)
        self.idle_since = 0.0

    def still_open(self) -> bool:
        """False when the server closed it (or sent something) while it sat idle.

        Asks the socket itself, like httpcore does, so a close the event loop has not processed yet
        is seen too: reusing such a connection would fail the request.
        """
        if self.writer.is_closing() or self.reader.at_eof():
            return False
        sock = self.writer.get_extra_info("socket")
        if sock is None:
            return True
        poller = select.poll()  # not select(): descriptors above 1023 are common with many streams
        poller.register(sock.fileno(), select.POLLIN)
        return not poller.poll(0)

    def close(self) -> None:
        # A FIN right away: for a stream cut short, this is what tells the engine to abort.
        self.writer.close()


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
        self._idle: dict[Origin, collections.deque[_Connection]] = {}
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
            await _send_request(conn, request, timeouts.get("write"))
            head = await _receive_head(conn, timeouts.get("read"), request)
        except BaseException:
            conn.close()  # cancelled or failed half-way: the connection's state is unknown
            raise
        return httpx.Response(
            status_code=head.status_code,
            headers=head.headers.raw_items(),
            stream=_ResponseStream(self, origin, conn, timeouts.get("read"), request),
            extensions={"http_version": b"HTTP/" + head.http_version, "reason_phrase": head.reason},
        )

    async def aclose(self) -> None:
        self._closed = True
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()

    def _checkout(self, origin: Origin) -> _Connection | None:
        idle = self._idle.get(origin)
        while idle:
            conn = idle.pop()  # newest first: the likeliest to be alive, and the oldest can expire
            if conn.still_open() and time.monotonic() - conn.idle_since < self.keepalive_expiry:
                return conn
            conn.close()
        return None

    def _release(self, origin: Origin, conn: _Connection) -> None:
        idle = self._idle.setdefault(origin, collections.deque())
        now = time.monotonic()
        while idle and now - idle[0].idle_since >= self.keepalive_expiry:
            idle.popleft().close()  # expired at the cold end: close them rather than hold the sockets
        if self._closed or len(idle) >= self.max_idle_per_origin:
            conn.close()
            return
        conn.idle_since = now
        idle.append(conn)

    async def _connect(self, origin: Origin, timeout: float | None, request: httpx.Request) -> _Connection:
        scheme, host, port = origin
        tls = self._ssl_context() if scheme == b"https" else None
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_connection(host.decode("ascii"), port, ssl=tls)
        except TimeoutError:
            raise httpx.ConnectTimeout(f"connecting to {request.url.host}:{port} timed out",
                                       request=request) from None
        except OSError as exc:
            raise httpx.ConnectError(str(exc), request=request) from exc
        return _Connection(reader, writer)

    def _ssl_context(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = ssl.create_default_context()  # built on first use: loading CAs takes ~0.1 s
        return self._ssl


class _ResponseStream(httpx.AsyncByteStream):
    def __init__(self, transport: UpstreamTransport, origin: Origin, conn: _Connection, read_timeout: float | None,
                 request: httpx.Request) -> None:
        self._transport = transport
        self._origin = origin
        self._conn: _Connection | None = conn
        self._read_timeout = read_timeout
        self._request = request
        self._complete = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        conn = self._conn
        if conn is None:
            raise httpx.StreamClosed()
        events = conn.h11
        while True:
            try:
                event = events.next_event()
            except h11.RemoteProtocolError as exc:  # e.g. the server closed mid-body
                raise httpx.RemoteProtocolError(str(exc), request=self._request) from exc
            if type(event) is h11.Data:
                yield bytes(event.data)
            elif event is h11.NEED_DATA:
                events.receive_data(await _read(conn, self._read_timeout, self._request))
            elif type(event) is h11.EndOfMessage:
                self._complete = True
                return
            else:
                raise httpx.RemoteProtocolError(f"unexpected {type(event).__name__} in a response body",
                                                request=self._request)

    async def aclose(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        events = conn.h11
        if self._complete and events.our_state is h11.DONE and events.their_state is h11.DONE:
            events.start_next_cycle()
            self._transport._release(self._origin, conn)
        else:
            conn.close()  # cut short (or `Connection: close`): never reuse a half-read connection


async def _send_request(conn: _Connection, request: httpx.Request, timeout: float | None) -> None:
    events = conn.h11
    writer = conn.writer
    stream = request.stream
    if not isinstance(stream, httpx.AsyncByteStream):
        raise RuntimeError("the upstream transport needs an async request body")
    try:
        head = events.send(h11.Request(method=request.method, target=request.url.raw_path,
                                       headers=request.headers.raw))
        if isinstance(stream, httpx.ByteStream):  # a body in memory: the whole request in one write
            body = b"".join([part async for part in stream])
            writer.write(b"".join((head, events.send(h11.Data(data=body)) if body else b"",
                                   events.send(h11.EndOfMessage()))))
        else:
            writer.write(head)
            async for part in stream:
                if part:
                    writer.write(events.send(h11.Data(data=part)))
                    if writer.transport.get_write_buffer_size():
                        await _drain(writer, timeout)
            writer.write(events.send(h11.EndOfMessage()))
        # A request that the socket took whole (the usual case) needs no timer armed and cancelled.
        if writer.transport.get_write_buffer_size() or writer.transport.is_closing():
            await _drain(writer, timeout)
    except TimeoutError:
        raise httpx.WriteTimeout("sending the request timed out", request=request) from None
    except OSError as exc:
        raise httpx.WriteError(str(exc), request=request) from exc
    except h11.LocalProtocolError as exc:
        raise httpx.LocalProtocolError(str(exc), request=request) from exc


async def _drain(writer: asyncio.StreamWriter, timeout: float | None) -> None:
    async with asyncio.timeout(timeout):
        await writer.drain()


async def _receive_head(conn: _Connection, timeout: float | None, request: httpx.Request) -> h11.Response:
    events = conn.h11
    while True:
        try:
            event = events.next_event()
        except h11.RemoteProtocolError as exc:
            raise httpx.RemoteProtocolError(str(exc), request=request) from exc
        if event is h11.NEED_DATA:
            events.receive_data(await _read(conn, timeout, request))
        elif type(event) is h11.Response:
            return event
        elif type(event) is h11.ConnectionClosed:
            raise httpx.RemoteProtocolError("the server closed the connection without answering",
                                            request=request)
        elif type(event) is not h11.InformationalResponse:  # a 1xx is skipped: the final answer follows
            # e.g. 101 Switching Protocols (h11 pauses): there is no HTTP response to relay.
            raise httpx.RemoteProtocolError(f"unexpected {event!r} instead of a response head", request=request)


async def _read(conn: _Connection, timeout: float | None, request: httpx.Request) -> bytes:
    try:
        if timeout is None:  # the streaming case: no timer to arm and cancel for every chunk
            return await conn.reader.read(_READ_SIZE)
        async with asyncio.timeout(timeout):
            return await conn.reader.read(_READ_SIZE)
    except TimeoutError:  # before OSError: TimeoutError is one
        raise httpx.ReadTimeout("reading from the upstream timed out", request=request) from None
    except OSError as exc:
        raise httpx.ReadError(str(exc), request=request) from exc
