"""Relaying an upstream response to the client chunk by chunk, and measuring it on the way.

Bytes go to the client as soon as httpx hands them over (no buffering, no re-encoding). A watcher on
`receive()` notices the client leaving and cancels the relay at once; the caller then closes the httpx
response, which closes the upstream connection so the engine aborts the request. When the upstream dies
mid-stream, an SSE stream gets a terminal `data: {"error": ...}` event and is then closed cleanly; so
does one whose first token or next chunk does not come within the policy's limits (`UpstreamTimeouts`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
import time

import httpx
from starlette.types import Message, Receive, Send

from decodeservice.common.errors import ServerError

# Connection-level headers are per hop (RFC 9110 7.6.1); the length is the ASGI server's business.
HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te", b"trailer",
    b"transfer-encoding", b"upgrade", b"content-length",
})
_MAX_USAGE_BUFFER = 1 << 20


# A choice carries output when its `text`, `content` or reasoning is a non-empty string, or its
# `tool_calls` a non-empty list. Inside a JSON string every `"` is escaped, so `"key"` followed by `:`
# can only be a real key: a byte search is exact without decoding the event. Values of other types
# (`null`, chat logprobs' `"content": [...]`) do not match. A reasoning model's thinking is output the
# client waits on: vLLM names it `reasoning` from 0.30 on (`reasoning_content` before; tests/support/contracts/).
_TOKEN = re.compile(rb'"(?:text|content|reasoning|reasoning_content)"\s*:\s*"[^"]|"tool_calls"\s*:\s*\[\s*[^\]\s]')
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
# An engine's error inside a stream: `data: {"error": {...}}` (vLLM from 0.10, OpenAI), or the flat
# `data: {"object": "error", ...}` of vLLM before 0.10 (tests/support/contracts/vllm/).
# A prefix test, and only on events without a token: a token event pays nothing for it.
_ERROR_EVENT = tuple(b"data:" + sp + b'{"' + key for sp in (b" ", b"")
                     for key in (b'error"', b'object":"error"', b'object": "error"'))


class SseMeter:
    """Incremental SSE scanner: when each token-carrying event arrived, the final usage if sent, and
    whether the upstream sent an error event (its status was 200 by then, but the request failed).

    It scans bytes instead of parsing each event's JSON: this runs for every chunk of every stream.
    """

    def __init__(self) -> None:
        self._partial = b""
        self.token_times: list[float] = []
        self.usage_completion_tokens: int | None = None
        self.error_event = False  # the upstream reported an error inside the stream

    def feed(self, chunk: bytes, now: float) -> None:
        lines = (self._partial + chunk if self._partial else chunk).split(b"\n")
        self._partial = lines.pop()  # the (possibly empty) unterminated tail
        for line in lines:
            if not line.startswith(b"data:"):
                continue
            if _TOKEN.search(line) is not None:
                self.token_times.append(now)
            elif line.startswith(_ERROR_EVENT):  # an error event carries no token (its text is escaped)
                self.error_event = True
            if b'"usage"' in line and (m := _COMPLETION_TOKENS.search(line)) is not None:
                self.usage_completion_tokens = int(m[1])

    @property
    def output_tokens(self) -> int:
        if self.usage_completion_tokens is not None:
            return self.usage_completion_tokens
        return len(self.token_times)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class UpstreamTimeouts:
    """The policy's `slo.firstTokenTimeoutMs` and `slo.streamStallTimeoutMs`, in seconds (None: off)."""

    first_token_s: float | None = None
    stall_s: float | None = None

    def message(self, kind: str) -> str:
        if kind == "first_token_timeout":
            return f"no first token from the upstream engine within slo.firstTokenTimeoutMs ({_ms(self.first_token_s)})"
        return f"the upstream engine sent nothing for slo.streamStallTimeoutMs ({_ms(self.stall_s)})"


NO_TIMEOUTS = UpstreamTimeouts()


def _ms(seconds: float | None) -> str:
    return "off" if seconds is None else f"{seconds * 1000:g} ms"


@dataclasses.dataclass(kw_only=True, slots=True)
class RelayResult:
    status: int
    started: bool = False  # the response head reached the ASGI server
    finished: float = 0.0
    disconnected: bool = False  # the client left; the relay stopped
    upstream_died: bool = False  # the upstream broke off mid-body
    timed_out: str | None = None  # "first_token_timeout" or "stall_timeout": the relay gave up on the upstream
    is_sse: bool = False
    body_tail: bytes = b""  # a non-streamed body (up to 1 MiB), to read `usage` from


def response_headers(response: httpx.Response, extra: list[tuple[bytes, bytes]] | None = None,
                     ) -> tuple[list[tuple[bytes, bytes]], bool]:
    """The headers to relay (per-hop ones dropped, `extra` added), and whether the body is SSE.

    One pass over the raw list: an httpx `Headers` lookup decodes every header each time.
    """
    headers = []
    is_sse = False
    for key, value in response.headers.raw:
        key = key.lower()
        if key in HOP_BY_HOP:
            continue
        if key == b"content-type":
            is_sse = is_sse or value.startswith(b"text/event-stream")
        headers.append((key, value))
    return headers + (extra or []), is_sse


async def relay(response: httpx.Response, *, receive: Receive, send: Send, meter: SseMeter | None,
                extra_headers: list[tuple[bytes, bytes]] | None = None,
                timeouts: UpstreamTimeouts = NO_TIMEOUTS, sent_at: float = 0.0) -> RelayResult:
    """Send the response to the client; return what happened. Does not close `response`.

    `timeouts.first_token_s` after `sent_at` (event-loop time the request went upstream) bounds the wait
    for an SSE stream's first token event; `timeouts.stall_s` bounds each wait for the upstream's next
    chunk after it (after the head for other bodies).

    `send` is the ASGI server's own, passed down untouched by every policy: a wrapper would cost a
    call per chunk. What a policy adds to the answer travels in `extra_headers` instead.
    """
    result = RelayResult(status=response.status_code)
    headers, result.is_sse = response_headers(response, extra_headers)
    # The pump runs in this task; only the disconnect watcher gets its own, and cancels this one when
    # the client leaves. (A task per side plus asyncio.wait cost about 5 % of the proxy's time per request.)
    this = asyncio.current_task()
    assert this is not None
    pumping = True

    def client_left(watch: asyncio.Task[None]) -> None:
        if pumping and not watch.cancelled():
            this.cancel()

    watch = asyncio.create_task(_wait_for_disconnect(receive))
    watch.add_done_callback(client_left)
    try:
        await _pump(response, send, meter, result, headers, timeouts, sent_at)
    except asyncio.CancelledError:
        if not watch.done() or watch.cancelled() or this.uncancel() > 0:
            raise  # cancelled from outside, not by the watcher
        result.disconnected = True
    except OSError:  # the ASGI server reports a vanished client this way
        result.disconnected = True
    finally:
        pumping = False
        watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch
    result.finished = time.perf_counter()
    return result


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message: Message = await receive()
        if message["type"] == "http.disconnect":
            return


class _Watchdog:
    """One timer per stream, moved only when it fires: the per-chunk cost is a clock read and two stores.

    (Rescheduling an `asyncio.timeout` around each read and off around each write cost about 2.5 us per
    chunk, some 3 % of the proxy's CPU per relayed token.) Until `mark` is set (the first token event)
    the timer stands at the first-token deadline; after it, a firing timer that finds the upstream
    heard from within `stall_s`, or the pump busy writing to the client (a slow reader is not an upstream
    stall), moves itself on instead of cancelling the pump.
    """

    __slots__ = ("_handle", "_loop", "_task", "busy", "fired", "mark", "stall_s")

    def __init__(self, loop: asyncio.AbstractEventLoop, task: asyncio.Task[object], when: float | None,
                 stall_s: float | None) -> None:
        self._loop = loop
        self._task = task
        self.stall_s = stall_s
        self.mark: float | None = None  # loop time the upstream was last heard from, once tokens flow
        self.busy = False
        self.fired = False
        self._handle = None if when is None else loop.call_at(when, self._check)

    def tokens_flow(self, now: float) -> None:
        """The first token event came: from now on only gaps count."""
        self.mark = now
        if self._handle is not None:
            self._handle.cancel()
        self._handle = None if self.stall_s is None else self._loop.call_at(now + self.stall_s, self._check)

    def _check(self) -> None:
        now = self._loop.time()
        if self.mark is not None and self.stall_s is not None:
            due = now + self.stall_s if self.busy else self.mark + self.stall_s
            if now < due:
                self._handle = self._loop.call_at(due, self._check)
                return
        self._handle = None
        self.fired = True
        self._task.cancel()

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


async def _pump(response: httpx.Response, send: Send, meter: SseMeter | None, result: RelayResult,
                headers: list[tuple[bytes, bytes]], timeouts: UpstreamTimeouts, sent_at: float) -> None:
    await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
    result.started = True
    if not result.is_sse:
        meter = None
    loop = asyncio.get_running_loop()
    dog: _Watchdog | None = None
    this = asyncio.current_task()
    assert this is not None
    if timeouts.first_token_s is not None or timeouts.stall_s is not None:
        first = None if timeouts.first_token_s is None else sent_at + timeouts.first_token_s
        dog = _Watchdog(loop, this, first if meter is not None else None, timeouts.stall_s)
        if meter is None:  # a plain body's "first token" was its head
            dog.tokens_flow(loop.time())
    tail = bytearray()
    try:
        async for chunk in response.aiter_raw():
            if meter is not None:
                meter.feed(chunk, time.perf_counter())  # the one clock read per chunk
            elif len(tail) < _MAX_USAGE_BUFFER:
                tail += chunk
            if dog is None:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                continue
            if dog.mark is None and meter is not None and meter.token_times:
                dog.tokens_flow(loop.time())
            dog.busy = True
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            dog.busy = False
            if dog.mark is not None:
                dog.mark = loop.time()
    except httpx.HTTPError as exc:
        result.upstream_died = True
        if result.is_sse:
            event = ServerError(f"upstream connection lost mid-stream: {type(exc).__name__}",
                                code="upstream_died").json()
            await send({"type": "http.response.body", "body": b"data: " + event + b"\n\n", "more_body": True})
    except asyncio.CancelledError:
        if dog is None or not dog.fired or this.uncancel() > 0:
            raise  # not (only) the watchdog: the client left, or the server is stopping
        result.timed_out = "first_token_timeout" if dog.mark is None else "stall_timeout"
        if result.is_sse:
            event = ServerError(timeouts.message(result.timed_out), status_code=504, code=result.timed_out).json()
            await send({"type": "http.response.body", "body": b"data: " + event + b"\n\n", "more_body": True})
    finally:
        if dog is not None:
            dog.stop()
    result.body_tail = bytes(tail)
    await send({"type": "http.response.body", "body": b"", "more_body": False})
