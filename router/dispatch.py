"""The completion routes' innermost component: hold, decide, forward (retrying before any byte went
to the client), relay, and learn from what came back.

A request's path: its prompt keys are computed (router/prompt_keys.py); while no endpoint is ready it
is held (`--hold-seconds`, at most `--max-held` at once; 503 with `Retry-After` past either); the
fleet's view of each ready endpoint is scored (router/scoring.py), shedding with 429 when none can
meet the objective; the body goes to the chosen endpoint's proxy unchanged. A failure before the
response head (refused, reset, the proxy's own 503 while it drains) marks that endpoint unready and
the request is decided again among the others, or held again, within the same hold deadline: nothing
was sent to the client yet, so nothing is lost. Once the head is relayed the stream is the client's,
byte for byte (proxy/streaming.py's relay, the proxy's own).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import re
import time
from collections.abc import Callable

import httpx
from starlette.types import Receive, Scope, Send

from decodeservice.common.errors import ServiceUnavailable
from decodeservice.proxy.context import RequestContext, get_context, set_response_status
from decodeservice.proxy.errors import Overloaded, UpstreamUnavailable
from decodeservice.proxy.policy import PriorityClass
from decodeservice.proxy.prefix_isolation import CACHE_SALT_FIELD, tenant_salt
from decodeservice.proxy.streaming import SseMeter, UpstreamTimeouts, relay
from decodeservice.proxy.upstream import forward_headers
from decodeservice.router.config import RouterConfig
from decodeservice.router.fleet import Fleet
from decodeservice.router.metrics import RouterMetrics
from decodeservice.router.prompt_keys import PromptKeys, prompt_keys
from decodeservice.router.scoring import decide, retry_after_seconds, should_shed

# A batch request is shed once the best endpoint is predicted past this share of the objective, an
# interactive one only past the whole of it: as load rises batch goes first, and what it leaves is the
# headroom interactive requests keep meeting the objective with.
BATCH_SHED_SHARE = 0.8
_MAX_URLS = 4096
MAX_ATTEMPTS = 8  # endpoints tried for one request before a 503 (each failure marks one unready)
_CACHED = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
_PROMPT = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Attempt:
    """A request sent to one endpoint whose response head came back."""

    response: httpx.Response
    url: str
    handle: int  # the fleet's record of it
    sent_at: float  # event-loop time it left for the endpoint (the relay's first-token clock)
    sent_perf: float  # the same instant on time.perf_counter(), the meter's clock


class HoldTimeout(ServiceUnavailable):
    code = "no_ready_endpoint"


def shed_objective(priority: PriorityClass, objective_s: float) -> float:
    """The predicted TTFT past which a request of this class is shed."""
    return objective_s * (BATCH_SHED_SHARE if priority is PriorityClass.BATCH else 1.0)


class RouterMeter(SseMeter):
    """The proxy's SSE meter, plus a call at the first token event and the usage's prompt counts."""

    def __init__(self, on_first_token: Callable[[float], None]) -> None:
        super().__init__()
        self._on_first_token = on_first_token
        self.cached_tokens: int | None = None
        self.prompt_tokens: int | None = None

    def feed(self, chunk: bytes, now: float) -> None:
        had_token = bool(self.token_times)
        super().feed(chunk, now)
        if not had_token and self.token_times:
            self._on_first_token(self.token_times[0])
        if b'"prompt_tokens"' in chunk:  # the usage chunk, usually whole; the last one wins
            read_usage(self, chunk)


def read_usage(meter: RouterMeter, data: bytes) -> None:
    if (m := _PROMPT.search(data)) is not None:
        meter.prompt_tokens = int(m[1])
    if (m := _CACHED.search(data)) is not None:
        meter.cached_tokens = int(m[1])


class Dispatcher:
    def __init__(self, *, config: RouterConfig, fleet: Fleet, client: httpx.AsyncClient,
                 metrics: RouterMetrics, timeouts: UpstreamTimeouts) -> None:
        self.config = config
        self.fleet = fleet
        self.client = client
        self.metrics = metrics
        self.timeouts = timeouts
        self.held = 0
        self._transport = getattr(client, "transport", None)
        # Per endpoint and route, the parsed URL: parsing a URL costs more than the rest of forwarding
        # a request (the proxy's Forwarder keeps them for the same reason). Emptied past _MAX_URLS, as
        # pods come and go with new addresses.
        self._urls: dict[tuple[str, str], httpx.URL] = {}
        self._timeout = client.timeout.as_dict()

    def salt(self, ctx: RequestContext) -> str | None:
        """The cache salt the engine will key this prompt by: the tenant's under isolatePrefixCache (the
        proxy sets it the same way), else whatever the client sent."""
        if self.config.policy.admission.isolate_prefix_cache:
            return tenant_salt(ctx.tenant)
        salt = ctx.body.get(CACHE_SALT_FIELD)
        return salt if isinstance(salt, str) else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ctx = get_context(scope)
        self.metrics.last_request.set(time.time())
        keys = prompt_keys(ctx.body, block_size=self.config.block_size, salt=self.salt(ctx))
        deadline = ctx.arrived + self.config.hold_seconds
        for _ in range(MAX_ATTEMPTS):
            if not self.fleet.ready_urls() and not await self._hold(ctx, receive, deadline):
                return  # the client left while held
            attempt = await self._open(scope, ctx, keys)
            if attempt is None:
                continue
            try:
                await self._relay(scope, ctx, receive, send, attempt, keys)
            finally:
                self.fleet.finished(attempt.url, attempt.handle)
            return
        raise UpstreamUnavailable(f"no endpoint answered after {MAX_ATTEMPTS} attempts",
                                  headers={"Retry-After": "1"}, reason="upstream_unavailable")

    async def _hold(self, ctx: RequestContext, receive: Receive, deadline: float) -> bool:
        """Wait for a ready endpoint (scale from zero); False if the client left meanwhile."""
        cls = ctx.priority.value
        retry = {"Retry-After": str(max(1, round(self.config.hold_seconds)))}
        if self.held >= self.config.max_held:
            self.metrics.shed.labels(cls, "hold_full").inc()
            raise HoldTimeout(f"no endpoint is ready and {self.config.max_held} requests are already held",
                              headers=retry, reason="hold_full")
        self.held += 1
        self.metrics.held.labels(cls).inc()
        left = asyncio.ensure_future(_disconnected(receive))
        ready = asyncio.ensure_future(self.fleet.wait_for_ready(max(0.0, deadline - time.perf_counter())))
        try:
            await asyncio.wait((left, ready), return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.held -= 1
            self.metrics.held.labels(cls).dec()
            for task in (left, ready):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if left.done() and not left.cancelled():
            ctx.client_disconnected = True
            return False
        if not (ready.done() and not ready.cancelled() and ready.result()):
            self.metrics.shed.labels(cls, "hold_timeout").inc()
            raise HoldTimeout(f"no endpoint became ready within {self.config.hold_seconds:g} s",
                              headers=retry, reason="hold_timeout")
        return True

    async def _open(self, scope: Scope, ctx: RequestContext, keys: PromptKeys) -> Attempt | None:
        """Decide and send; None when the chosen endpoint failed before its response head."""
        views = self.fleet.views(ctx.priority, keys)
        objective = self.config.ttft_objective_s
        threshold = shed_objective(ctx.priority, objective)
        predicted = should_shed(views, prompt_tokens=keys.tokens, objective_s=threshold)
        if predicted is not None:
            self.metrics.shed.labels(ctx.priority.value, "slo").inc()
            raise Overloaded(
                f"overloaded: every endpoint's predicted time to first token (best {predicted * 1000:.0f} ms) "
                f"exceeds the {objective * 1000:g} ms objective for {ctx.priority.value} requests",
                headers={"Retry-After": str(retry_after_seconds(predicted, threshold))}, reason="slo")
        decision = decide(views, prompt_tokens=keys.tokens, conversation=keys.conversation, objective_s=objective)
        url = decision.endpoint
        handle = self.fleet.dispatched(url, uncached=max(1, keys.tokens - decision.hit_tokens),
                                       predicted_ttft_s=decision.predicted_ttft_s)
        target = self._urls.get((url, scope["path"]))
        if target is None:
            if len(self._urls) >= _MAX_URLS:
                self._urls.clear()
            target = self._urls[url, scope["path"]] = httpx.URL(url + scope["path"])
        request = httpx.Request("POST", target, content=ctx.raw_body,
                                headers=forward_headers(scope, content_type=b"application/json"),
                                extensions={"timeout": self._timeout})
        sent_at, sent_perf = asyncio.get_running_loop().time(), time.perf_counter()
        first_token_s = self.timeouts.first_token_s
        try:
            async with asyncio.timeout_at(None if first_token_s is None else sent_at + first_token_s):
                response = await self._send(request)
        except (httpx.HTTPError, TimeoutError):
            self.fleet.finished(url, handle)
            self.fleet.mark_unready(url)
            return None
        if response.status_code == 503:  # the endpoint's proxy is draining or its engine is down
            await response.aclose()
            self.fleet.finished(url, handle)
            self.fleet.mark_unready(url)
            return None
        self.fleet.index.record(url, keys.blocks)
        self.metrics.decisions.labels(url, decision.reason.value).inc()
        self.metrics.predicted_ttft.labels(ctx.priority.value).observe(decision.predicted_ttft_s)
        self.metrics.prefix_predicted.inc(decision.hit_tokens)
        return Attempt(response=response, url=url, handle=handle, sent_at=sent_at, sent_perf=sent_perf)

    async def _send(self, request: httpx.Request) -> httpx.Response:
        if isinstance(self._transport, httpx.AsyncBaseTransport):
            response = await self._transport.handle_async_request(request)
            response.request = request
            return response
        return await self.client.send(request, stream=True)

    async def _relay(self, scope: Scope, ctx: RequestContext, receive: Receive, send: Send,
                     attempt: Attempt, keys: PromptKeys) -> None:
        response, url, handle = attempt.response, attempt.url, attempt.handle
        priority = ctx.priority.value

        def first_token(at: float) -> None:
            self.fleet.first_token(url, handle, ttft_s=at - attempt.sent_perf)
            self.metrics.ttft.labels(priority).observe(at - ctx.arrived)

        meter = RouterMeter(first_token)
        try:
            result = await relay(response, receive=receive, send=send, meter=meter, timeouts=self.timeouts,
                                 sent_at=attempt.sent_at)
        finally:
            await response.aclose()
        if result.started:
            set_response_status(scope, result.status)
        if result.disconnected:
            ctx.client_disconnected = True
        if not result.is_sse and result.body_tail:
            _usage_from_body(meter, result.body_tail)
        self.metrics.prompt_tokens.inc(meter.prompt_tokens if meter.prompt_tokens is not None else keys.tokens)
        if meter.cached_tokens is not None:
            self.metrics.prefix_cached.inc(meter.cached_tokens)


def _usage_from_body(meter: RouterMeter, body: bytes) -> None:
    try:
        usage = json.loads(body).get("usage")
    except (ValueError, AttributeError):
        return
    if isinstance(usage, dict):
        read_usage(meter, json.dumps(usage).encode())


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
