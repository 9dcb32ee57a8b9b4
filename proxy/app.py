"""The proxy app: routes, the policy chain, the error boundary, draining.

POST /v1/completions and /v1/chat/completions go through

    ErrorBoundary > DrainGate > JsonBody (413/400) > OutputLength > [TenantRateLimit]
    > [PrefixCacheIsolation] > Admission > BatchingWindow > Forwarder

Cheap refusals come first, so nothing is queued or counted that would be refused anyway. Every other
path except the proxy's own /health, /ready and /metrics is passed through to the upstream untouched.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.datastructures import State
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from decodeservice.common.errors import (
    Draining,
    OpenAIError,
    ServiceUnavailable,
    http_exception_handler,
)
from decodeservice.common.lifecycle import Lifecycle, Phase
from decodeservice.proxy.admission import Admission
from decodeservice.proxy.batching_window import BatchingWindow
from decodeservice.proxy.context import SCOPE_KEY, RequestContext, response_status, set_response_status
from decodeservice.proxy.engine_metrics import EngineMetricsRelay
from decodeservice.proxy.errors import Overloaded
from decodeservice.proxy.metrics import CONTENT_TYPE, ProxyMetrics
from decodeservice.proxy.output_length import OutputLength
from decodeservice.proxy.policy import Policy
from decodeservice.proxy.prefix_isolation import PrefixCacheIsolation
from decodeservice.proxy.request_body import JsonBody
from decodeservice.proxy.streaming import UpstreamTimeouts
from decodeservice.proxy.tenant_rate import TenantRateLimit
from decodeservice.proxy.tokens import LocalTokenCounter, TokenCounter, UpstreamTokenCounter
from decodeservice.proxy.upstream import Forwarder, PassThrough, make_client
from decodeservice.proxy.upstream_health import EngineKind, UpstreamHealth

log = logging.getLogger(__name__)
COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")


class DrainGate:
    """Once the lifecycle drains, new requests get 503; the ones let in are counted for the drain."""

    def __init__(self, app: ASGIApp, *, lifecycle: Lifecycle):
        self.app = app
        self.lifecycle = lifecycle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.lifecycle.phase is Phase.DRAINING:
            raise Draining()
        self.lifecycle.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.lifecycle.leave()


class ErrorBoundary:
    """Renders OpenAIError as OpenAI error JSON and counts every answer by class and status.

    What it counts is handed in (the proxy's and the router's metrics differ): `count_answer(cls, status)`
    for every answer, `count_refusal(scope, exc)` for each error it renders."""

    def __init__(self, app: ASGIApp, *, count_answer: Callable[[str, int], None],
                 count_refusal: Callable[[Scope, OpenAIError], None] | None = None):
        self.app = app
        self.count_answer = count_answer
        self.count_refusal = count_refusal

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # `send` goes down untouched (no per-chunk wrapper); the relay records the status it sent.
        try:
            await self.app(scope, receive, send)
        except OpenAIError as exc:
            if response_status(scope):
                raise  # internal invariant broken: components only raise before answering
            set_response_status(scope, exc.status_code)
            if self.count_refusal is not None:
                self.count_refusal(scope, exc)
            await exc.to_response()(scope, receive, send)
        status = response_status(scope)
        ctx = scope.get(SCOPE_KEY)
        cls = ctx.priority.value if isinstance(ctx, RequestContext) else "unknown"
        if isinstance(ctx, RequestContext) and ctx.client_disconnected:
            status = 499  # nginx's "client closed request"
        self.count_answer(cls, status)


def proxy_refusal_counter(metrics: ProxyMetrics) -> Callable[[Scope, OpenAIError], None]:
    """Counts a refusal the proxy rendered: 429s as shed by class and reason, other 4xx as rejected."""
    def count(scope: Scope, exc: OpenAIError) -> None:
        ctx = scope.get(SCOPE_KEY)
        if isinstance(exc, Overloaded) and isinstance(ctx, RequestContext):
            metrics.shed.labels(ctx.priority.value, exc.reason).inc()
        elif 400 <= exc.status_code < 500:
            metrics.rejected.labels(exc.reason).inc()
    return count


class ProxyApp:
    """The proxy's ASGI app: POSTs to the completion paths go straight to the policy chain, the rest
    to a Starlette router.

    Starlette's error and exception middleware each wrap `send`, a call per chunk of every stream. The
    chain has its own error boundary, and an unexpected exception is answered 500 by uvicorn just as
    by that middleware, so skipping it changes nothing a client sees. The same routes stay in the
    router for anything the shortcut does not match exactly. Composition over the public ASGI
    interface, so no Starlette internals are overridden.
    """

    def __init__(self, router: Starlette, *, completions: ASGIApp) -> None:
        self.router = router
        self.completions = completions

    @property
    def state(self) -> State:
        return self.router.state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in COMPLETION_PATHS:
            scope["app"] = self.router  # what Starlette's Request.app reads, as if routed
            await self.completions(scope, receive, send)
            return
        await self.router(scope, receive, send)


def create_app(
    policy: Policy,
    upstream_url: str,
    *,
    tokenizer_path: str | None = None,
    lifecycle: Lifecycle | None = None,
    engine_kind: EngineKind | str = EngineKind.BUILTIN,
    upstream_health: UpstreamHealth | None = None,
) -> ProxyApp:
    """Build the proxy. `lifecycle` lets the server (or a test) start draining; one is made if absent.
    `engine_kind` is what the upstream is; `upstream_health` what /ready asks it (default: the kind's path)."""
    metrics = ProxyMetrics(policy)
    lifecycle = lifecycle or Lifecycle(phase=Phase.READY)
    kind = EngineKind(engine_kind)
    health_check = upstream_health or UpstreamHealth.for_engine(kind)
    client = make_client(max_connections=policy.admission.max_inflight + 16)
    counter: TokenCounter = (
        LocalTokenCounter(tokenizer_path) if tokenizer_path
        else UpstreamTokenCounter(client, upstream_url, engine_kind=kind)
    )
    slo = policy.slo
    timeouts = UpstreamTimeouts(
        first_token_s=None if slo.first_token_timeout_ms is None else slo.first_token_timeout_ms / 1000,
        stall_s=None if slo.stream_stall_timeout_ms is None else slo.stream_stall_timeout_ms / 1000,
    )
    chain: ASGIApp = Forwarder(client=client, upstream_url=upstream_url, metrics=metrics, timeouts=timeouts)
    window = BatchingWindow(chain, classes=policy.classes, metrics=metrics)
    chain = window
    admission = Admission(chain, policy=policy, metrics=metrics)
    chain = admission
    if policy.admission.isolate_prefix_cache:
        chain = PrefixCacheIsolation(chain)
    if policy.admission.tenant_tokens_per_minute is not None:
        chain = TenantRateLimit(chain, tokens_per_minute=policy.admission.tenant_tokens_per_minute, counter=counter)
    chain = OutputLength(chain, policy=policy.output_length, counter=counter, metrics=metrics)
    chain = JsonBody(chain, max_body_bytes=policy.output_length.max_body_bytes,
                     default_class=policy.admission.default_class)
    def count_answer(cls: str, status: int) -> None:
        metrics.answered(cls, status).inc()

    count_refusal = proxy_refusal_counter(metrics)
    completions = ErrorBoundary(DrainGate(chain, lifecycle=lifecycle), count_answer=count_answer,
                                count_refusal=count_refusal)
    passthrough = ErrorBoundary(
        DrainGate(PassThrough(client=client, upstream_url=upstream_url, metrics=metrics), lifecycle=lifecycle),
        count_answer=count_answer, count_refusal=count_refusal,
    )

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(request: Request) -> Response:
        if lifecycle.draining:
            return Draining("the proxy is draining").to_response()
        if not await health_check.ready(client, upstream_url):
            return ServiceUnavailable("the upstream engine is not ready", code="upstream_not_ready",
                                      headers={"Retry-After": "1"}).to_response()
        return JSONResponse({"status": "ready"})

    engine_metrics = EngineMetricsRelay(client, upstream_url)

    async def metrics_endpoint(request: Request) -> Response:
        # The engine's vllm:* series follow the proxy's own, for the operator's autoscaler (METRICS.md).
        return Response(metrics.render() + await engine_metrics.render(), media_type=CONTENT_TYPE)

    async def method_not_allowed(request: Request) -> Response:
        return OpenAIError(f"{request.method} is not allowed here; use POST", status_code=405,
                           headers={"Allow": "POST"}).to_response()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await client.aclose()

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        *(Route(path, completions, methods=["POST"]) for path in COMPLETION_PATHS),
        # Other methods on these paths are answered here, not passed through to the engine.
        *(Route(path, method_not_allowed) for path in COMPLETION_PATHS),
        Mount("/", passthrough),
    ]
    router = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_exception_handler})
    app = ProxyApp(router, completions=completions)
    app.state.policy = policy
    app.state.metrics = metrics
    app.state.lifecycle = lifecycle
    app.state.admission = admission
    app.state.window = window
    app.state.client = client
    app.state.engine_metrics = engine_metrics
    app.state.upstream_health = health_check
    return app
