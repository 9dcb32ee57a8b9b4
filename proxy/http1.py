"""One HTTP/1.1 client connection: the request written by hand, the response parsed by llhttp.

`Connection` is an asyncio protocol. Bytes go into httptools' parser as the event loop hands them over;
its callbacks fill in the response, queue body chunks and wake the one task reading them. A reader that
fell behind takes everything queued as one chunk, and reading pauses while 256 KiB wait, so a slow
client holds the upstream back instead of filling the proxy's memory. Errors are stored, not raised,
so the waiting task raises them as httpx's. The pool and the httpx side live in `transport.py`.
"""

from __future__ import annotations

import asyncio
import collections
import re
import select
from typing import cast

import httptools
import httpx

# Reading pauses while this much body waits for a slow consumer (the client behind the proxy).
_HIGH_WATER = 256 * 1024
# RFC 9110 field names are tokens; values may not hold CR, LF or NUL (h11 checks the same). Checked
# field by field: a value smuggling "\r\nname: value" would make a whole block look valid.
_FIELD_NAME = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_FIELD_VALUE = re.compile(rb"[^\x00\r\n]*")
_TARGET = re.compile(rb"[^\x00-\x20\x7f]+")


class Connection(asyncio.Protocol):
    """One HTTP/1.1 connection and the response being read on it.

    The parser runs inside `data_received`; its callbacks (`on_*`) fill in the response and wake the
    one task waiting for it. Errors are stored, not raised, so the waiting task raises them as httpx's.
    """

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.idle_since = 0.0
        self.lost = False
        self.awaiting = False  # a request was sent and its response is not complete
        self._waiter: asyncio.Future[None] | None = None
        self._drained: asyncio.Future[None] | None = None
        self._reading_paused = False
        self._reset(head_only=False)

    def _reset(self, *, head_only: bool) -> None:
        self.head_only = head_only  # a HEAD's response has no body, whatever its headers say
        self.status = 0
        self.reason = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.http_version = b"HTTP/1.1"
        self.keep_alive = False
        self.framed = False  # Content-Length or chunked: a close before the end is an error
        self.head_done = False
        self.complete = False
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.error: str | None = None

    # -- asyncio.Protocol ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if not self.awaiting:
            # Bytes nobody asked for (or past the end of the response): the connection's framing can
            # no longer be trusted, so it is never reused.
            self.lost = True
            self.close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail("the server switched protocols (101); there is no HTTP response to relay")
        except httptools.HttpParserError as exc:
            self._fail(f"malformed response from the server: {exc}")

    def eof_received(self) -> bool:
        return False  # half-closed is closed: the transport closes and connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.awaiting and not self.complete and self.error is None:
            if self.head_done and not self.framed:
                self._finish()  # the body ran until the close, as HTTP/1.0 allows
            elif self.head_done:
                self.error = "the server closed the connection before the response body ended"
            else:
                self.error = "the server closed the connection without answering"
        self._wake()
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    def pause_writing(self) -> None:
        if self._drained is None or self._drained.done():
            self._drained = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    # -- httptools callbacks ---------------------------------------------------------------------

    def on_status(self, reason: bytes) -> None:
        self.reason += reason  # may come in pieces

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))
        lowered = name.lower()
        if lowered == b"content-length" or lowered == b"transfer-encoding":
            self.framed = True

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200:
            # 1xx: the final answer follows on the same connection (a 101 ends in HttpParserUpgrade).
            self.reason, self.headers, self.framed = b"", [], False
            return
        self.status = status
        self.http_version = b"HTTP/" + self.parser.get_http_version().encode()
        self.keep_alive = self.parser.should_keep_alive()
        self.head_done = True
        if self.head_only:
            # llhttp would wait for the body the headers announce; the connection is dropped instead.
            self.keep_alive = False
            self._finish()
        self._wake()

    def on_body(self, body: bytes) -> None:
        if self.complete:
            return  # a HEAD's phantom body
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > _HIGH_WATER and not self._reading_paused and self.transport is not None:
            self._reading_paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self.head_done and not self.complete:
            self._finish()

    # -- used by the transport -------------------------------------------------------------------

    def _finish(self) -> None:
        self.complete = True
        self.awaiting = False
        self._wake()

    def _fail(self, message: str) -> None:
        self.error = message
        self.close()
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self, timeout: float | None) -> None:
        """Until the parser or the socket reports anything."""
        self._waiter = waiter = asyncio.get_running_loop().create_future()
        try:
            if timeout is None:  # the streaming case: no timer armed and cancelled per chunk
                await waiter
            else:
                async with asyncio.timeout(timeout):
                    await waiter
        finally:
            self._waiter = None

    async def drain(self) -> None:
        # A lost connection resolves this too; reading the head then tells what the server said, if anything.
        if self._drained is not None:
            await self._drained

    def take_body(self) -> bytes:
        chunks = self.chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self.buffered = 0
        if self._reading_paused and self.transport is not None:
            self._reading_paused = False
            self.transport.resume_reading()
        return data

    def begin(self, *, head_only: bool) -> None:
        self._reset(head_only=head_only)
        self.awaiting = True

    def still_open(self) -> bool:
        """False when the server closed it (or sent something) while it sat idle.

        Asks the socket itself, like httpcore does, so a close the event loop has not processed yet
        is seen too: reusing such a connection would fail the request.
        """
        transport = self.transport
        if self.lost or transport is None or transport.is_closing():
            return False
        sock = transport.get_extra_info("socket")
        if sock is None:
            return True
        poller = select.poll()  # not select(): descriptors above 1023 are common with many streams
        poller.register(sock.fileno(), select.POLLIN)
        return not poller.poll(0)

    def close(self) -> None:
        # A FIN right away: for a stream cut short, this is what tells the engine to abort.
        if self.transport is not None:
            self.transport.close()


async def send_request(conn: Connection, request: httpx.Request, timeout: float | None) -> None:
    transport = conn.transport
    assert transport is not None
    stream = request.stream
    if not isinstance(stream, httpx.AsyncByteStream):
        raise RuntimeError("the upstream transport needs an async request body")
    target = request.url.raw_path
    lines = []
    length: int | None = None
    chunked = False
    for name, value in request.headers.raw:  # one pass: an httpx Headers lookup decodes every header
        if _FIELD_NAME.fullmatch(name) is None or _FIELD_VALUE.fullmatch(value) is None:
            raise httpx.LocalProtocolError(f"illegal character in the request header {name!r}", request=request)
        lines.append(name + b": " + value + b"\r\n")
        lowered = name.lower()
        if lowered == b"content-length":
            if not value.isdigit():
                raise httpx.LocalProtocolError(f"invalid Content-Length {value!r}", request=request)
            length = int(value)
        elif lowered == b"transfer-encoding":
            chunked = value.strip().lower() == b"chunked"
    if _TARGET.fullmatch(target) is None:
        raise httpx.LocalProtocolError(f"illegal character in the request target {target!r}", request=request)
    head = b"".join((request.method.encode("ascii"), b" ", target, b" HTTP/1.1\r\n", *lines, b"\r\n"))
    chunked = chunked and length is None
    try:
        if isinstance(stream, httpx.ByteStream):  # a body in memory: the whole request in one write
            body = b"".join([part async for part in stream])
            _check_length(length, len(body), request)
            transport.write(head + (_chunk(body) + b"0\r\n\r\n" if chunked else body))
        else:
            transport.write(head)
            sent = 0
            async for part in stream:
                if conn.lost:
                    break  # the server answered early (an error, say) and closed: read that answer
                if part:
                    sent += len(part)
                    transport.write(_chunk(part) if chunked else part)
                    await _drain(conn, timeout)
            if conn.lost:
                return
            _check_length(length, sent, request)
            if chunked:
                transport.write(b"0\r\n\r\n")
        # A request that the socket took whole (the usual case) needs no timer armed and cancelled.
        if transport.get_write_buffer_size() or conn.lost:
            await _drain(conn, timeout)
    except TimeoutError:
        raise httpx.WriteTimeout("sending the request timed out", request=request) from None
    except OSError as exc:
        raise httpx.WriteError(str(exc), request=request) from exc


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data) if data else b""


def _check_length(declared: int | None, sent: int, request: httpx.Request) -> None:
    if declared is not None and declared != sent:
        raise httpx.LocalProtocolError(f"the body has {sent} bytes, Content-Length says {declared}",
                                       request=request)


async def _drain(conn: Connection, timeout: float | None) -> None:
    if timeout is None:
        await conn.drain()
        return
    async with asyncio.timeout(timeout):
        await conn.drain()
