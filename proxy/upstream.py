"""Talking to the upstream engine with httpx: the policy chain's innermost app and plain pass-through.

(What the proxy's /ready asks the upstream is proxy/upstream_health.py.)

Failures before the response starts (connection refused, reset, timeout) are answered 503 with
`Retry-After`; no response head within `slo.firstTokenTimeoutMs` is a 504; failures after it are
handled by the relay (terminal SSE error event, clean close).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
from starlette.types import Receive, Scope, Send

from decodeservice.proxy.context import get_context, set_response_status
from decodeservice.proxy.errors import UpstreamTimeout, UpstreamUnavailable
from decodeservice.proxy.metrics import ProxyMetrics
from decodeservice.proxy.slo import RequestOutcome
from decodeservice.proxy.streaming import NO_TIMEOUTS, SseMeter, UpstreamTimeouts, relay
from decodeservice.proxy.transport import UpstreamTransport

RETRY_AFTER_SECONDS = 1
_DROP_REQUEST_HEADERS = frozenset({
    b"host", b"content-length", b"connection", b"keep-alive", b"transfer-encoding", b"te", b"upgrade",
    b"accept-encoding", b"proxy-authorization",
})
_DROP_WITH_CONTENT_TYPE = _DROP_REQUEST_HEADERS | {b"content-type"}


class _NoCookies(httpx.Cookies):
    def extract_cookies(self, response: httpx.Response) -> None:
        pass  # not even parsed: building the cookie-compatible request alone is per-response work a proxy need not do


class UpstreamClient(httpx.AsyncClient):
    """httpx's client, except that it keeps no cookies.

    One user's `Set-Cookie` must never ride along on the next user's request (the header itself is
    still relayed to the client that got it), and the cookie bookkeeping was about 5 % of the proxy's
    CPU per request.
    """

    def __init__(self, *, transport: UpstreamTransport, **kwargs: Any) -> None:
        super().__init__(transport=transport, **kwargs)
        # The transport every request takes: a client given its own transport mounts no proxies from
        # the environment, so this is the one httpx would pick, known without asking httpx's internals.
        self.transport = transport
        self._none = _NoCookies()

    @property
    def cookies(self) -> httpx.Cookies:
        return self._none

    @cookies.setter
    def cookies(self, cookies: Any) -> None:
        pass


def make_client(*, max_connections: int) -> httpx.AsyncClient:
    """The proxy's one client to the upstream; up to `max_connections` idle connections are kept."""
    # No read timeout here: the Forwarder bounds the first token and the gaps after it by the policy
    # (`UpstreamTimeouts`); anything else (pass-through) may legitimately take its time.
    timeout = httpx.Timeout(connect=5.0, read=None, write=30.0, pool=None)
    return UpstreamClient(transport=UpstreamTransport(max_idle_per_origin=max_connections), timeout=timeout)


def forward_headers(scope: Scope, *, content_type: bytes | None = None) -> list[tuple[bytes, bytes]]:
    """The client's request headers minus the per-hop ones; `content_type` replaces the client's."""
    drop = _DROP_REQUEST_HEADERS if content_type is None else _DROP_WITH_CONTENT_TYPE
    headers = [(k, v) for k, v in scope["headers"] if k not in drop]
    # Identity encoding keeps the SSE bytes readable for the meter and free of re-compression.
    headers.append((b"accept-encoding", b"identity"))
    if content_type is not None:
        headers.append((b"content-type", content_type))
    return headers


async def _open(client: httpx.AsyncClient, request: httpx.Request, metrics: ProxyMetrics,
                transport: httpx.AsyncBaseTransport | None = None) -> httpx.Response:
    """Send `request`, mapping a failure before the response to 503.

    With `transport` the client's send machinery (auth, redirects, cookies, event hooks) is skipped:
    the proxy's client configures none of it, and those layers cost about half as much as the transport.
    `handle_async_request` is the public transport interface (the one custom transports implement);
    the response then lacks only what the client would add (`elapsed`, closing through the client),
    which the relay does not use: it closes the response itself.
    """
    try:
        if transport is None:
            return await client.send(request, stream=True)
        if client.is_closed:
            raise RuntimeError("Cannot send a request, as the client has been closed.")
        response = await transport.handle_async_request(request)
        response.request = request
        return response
    except httpx.HTTPError as exc:
        kind = "unreachable" if isinstance(exc, httpx.ConnectError) else "failed_before_response"
        metrics.upstream_errors.labels(kind).inc()
        raise UpstreamUnavailable(
            f"upstream engine unavailable: {type(exc).__name__}",
            headers={"Retry-After": str(RETRY_AFTER_SECONDS)}, reason=kind,
        ) from None


class Forwarder:
    """Sends the (policy-rewritten) JSON body upstream and relays the answer, measuring it."""

    def __init__(self, *, client: httpx.AsyncClient, upstream_url: str, metrics: ProxyMetrics,
                 timeouts: UpstreamTimeouts = NO_TIMEOUTS):
        self.client = client
        self.base = upstream_url.rstrip("/")
        self.metrics = metrics
        self.timeouts = timeouts
        # Per completion route, the parsed URL: parsing a URL costs more than the rest of a request.
        self._urls: dict[str, httpx.URL] = {}
        # Our own client's transport is called directly; any other client goes through `send`.
        self._transport = client.transport if isinstance(client, UpstreamClient) else None
        self._timeout = client.timeout.as_dict()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ctx = get_context(scope)
        path: str = scope["path"]
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = httpx.URL(self.base + path)
        # The client's own bytes when no policy changed the body: same JSON, no re-serialising.
        content = json.dumps(ctx.body).encode() if ctx.body_rewritten else ctx.raw_body
        # Built directly, not by `client.build_request`: merging in the client's defaults (User-Agent,
        # Accept, keep-alive) adds nothing an HTTP/1.1 upstream needs and costs as much again.
        request = httpx.Request("POST", url, content=content,
                                headers=forward_headers(scope, content_type=b"application/json"),
                                extensions={"timeout": self._timeout})
        started = time.perf_counter()
        sent_at = asyncio.get_running_loop().time()
        first_token_s = self.timeouts.first_token_s
        try:
            # Cancelling the send closes its connection (UpstreamTransport), so the engine aborts.
            async with asyncio.timeout_at(None if first_token_s is None else sent_at + first_token_s):
                response = await _open(self.client, request, self.metrics, self._transport)
        except TimeoutError:
            self.metrics.upstream_errors.labels("first_token_timeout").inc()
            raise UpstreamTimeout(self.timeouts.message("first_token_timeout")) from None
        meter = SseMeter()
        try:
            result = await relay(response, receive=receive, send=send, meter=meter,
                                 extra_headers=ctx.response_headers, timeouts=self.timeouts, sent_at=sent_at)
        finally:
            await response.aclose()  # on a disconnect or timeout this drops the upstream connection: the engine aborts
        if result.started:
            set_response_status(scope, result.status)
        if result.upstream_died:
            self.metrics.upstream_errors.labels("died_mid_stream").inc()
        if result.timed_out is not None:
            self.metrics.upstream_errors.labels(result.timed_out).inc()
        if result.disconnected:
            ctx.client_disconnected = True
        if not result.is_sse:
            ctx.output_tokens = _usage_tokens(result.body_tail)
        else:
            ctx.output_tokens = meter.output_tokens
        if meter.error_event:
            self.metrics.upstream_errors.labels("error_event").inc()
        if (result.status != 200 or result.disconnected or result.upstream_died or result.timed_out is not None
                or meter.error_event):
            return
        times = meter.token_times
        first = times[0] if times else None
        self.metrics.record(RequestOutcome(
            priority=ctx.priority,
            finished=result.finished,
            ttft=None if first is None else first - ctx.arrived,
            upstream_ttft=None if first is None else first - started,
            service_time=result.finished - started,
            e2e=result.finished - ctx.arrived,
            itls=tuple(b - a for a, b in zip(times, times[1:], strict=False)),
            output_tokens=ctx.output_tokens,
            streamed=result.is_sse,
        ))


def _usage_tokens(body: bytes) -> int:
    try:
        data = json.loads(body)
    except ValueError:
        return 0
    usage = data.get("usage") if isinstance(data, dict) else None
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return tokens if isinstance(tokens, int) else 0


class PassThrough:
    """Forwards any other request (GET /v1/models, POST /tokenize, ...) without policies."""

    def __init__(self, *, client: httpx.AsyncClient, upstream_url: str, metrics: ProxyMetrics):
        self.client = client
        self.base = upstream_url.rstrip("/")
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = bytearray()
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
        query = scope.get("query_string", b"").decode("latin-1")
        url = self.base + scope["path"] + (f"?{query}" if query else "")
        request = self.client.build_request(scope["method"], url, content=bytes(body),
                                            headers=forward_headers(scope))
        response = await _open(self.client, request, self.metrics)
        try:
            result = await relay(response, receive=receive, send=send, meter=None)
        finally:
            await response.aclose()
        if result.started:
            set_response_status(scope, result.status)

