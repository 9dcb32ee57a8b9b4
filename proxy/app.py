"""The proxy app: routes, the policy chain, the error boundary, draining.

POST /v1/completions and /v1/chat/completions go through

    ErrorBoundary > DrainGate > JsonBody (413/400) > OutputLength > [TenantRateLimit] > Admission
    > BatchingWindow > Forwarder

Cheap refusals come first, so nothing is queued or counted that would be refused anyway. Every other
path except the proxy's own /health, /ready and /metrics is passed through to the upstream untouched.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from decodeservice.proxy.admission import Admission
from decodeservice.proxy.batching_window import BatchingWindow
from decodeservice.proxy.context import SCOPE_KEY, RequestContext, response_status, set_response_status
from decodeservice.proxy.engine_metrics import EngineMetricsRelay
from decodeservice.proxy.errors import Draining, Overloaded, ProxyError, error_response
from decodeservice.proxy.metrics import CONTENT_TYPE, ProxyMetrics
from decodeservice.proxy.output_length import OutputLength
from decodeservice.proxy.policy import Policy
from decodeservice.proxy.request_body import JsonBody
from decodeservice.proxy.tenant_rate import TenantRateLimit
from decodeservice.proxy.tokens import LocalTokenCounter, TokenCounter, UpstreamTokenCounter
from decodeservice.proxy.upstream import Forwarder, PassThrough, make_client, upstream_ready

log = logging.getLogger(__name__)
COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")


class DrainState:
    """After `begin()`, new requests get 503 and /ready fails; `wait_idle()` returns once in-flight ends."""

    def __init__(self) -> None:
        self.draining = False
        self.active = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def begin(self) -> None:
        self.draining = True

    def enter(self) -> None:
        self.active += 1
        self._idle.clear()

    def leave(self) -> None:
        self.active -= 1
        if self.active == 0:
            self._idle.set()

    async def wait_idle(self) -> None:
        await self._idle.wait()


class DrainGate:
    def __init__(self, app: ASGIApp, *, drain: DrainState):
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.drain.draining:
            raise Draining("the proxy is shutting down; retry on another replica", headers={"Retry-After": "1"})
        self.drain.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.leave()


class ErrorBoundary:
    """Renders ProxyError as OpenAI error JSON and counts every answer by class and status."""

    def __init__(self, app: ASGIApp, *, metrics: ProxyMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # `send` goes down untouched (no per-chunk wrapper); the relay records the status it sent.
        try:
            await self.app(scope, receive, send)
        except ProxyError as exc:
            if response_status(scope):
                raise  # internal invariant broken: components only raise before answering
            set_response_status(scope, exc.status_code)
            self._count_refusal(scope, exc)
            await exc.to_response()(scope, receive, send)
        status = response_status(scope)
        ctx = scope.get(SCOPE_KEY)
        cls = ctx.priority.value if isinstance(ctx, RequestContext) else "unknown"
        if isinstance(ctx, RequestContext) and ctx.client_disconnected:
            status = 499  # nginx's "client closed request"
        self.metrics.answered(cls, status).inc()

    def _count_refusal(self, scope: Scope, exc: ProxyError) -> None:
        ctx = scope.get(SCOPE_KEY)
        if isinstance(exc, Overloaded) and isinstance(ctx, RequestContext):
            self.metrics.shed.labels(ctx.priority.value, exc.reason).inc()
        elif 400 <= exc.status_code < 500:
            self.metrics.rejected.labels(exc.reason).inc()


class ProxyApp(Starlette):
    """Starlette, except that POSTs to the completion paths go straight to the policy chain.

    Starlette's error and exception middleware each wrap `send`, a call per chunk of every stream. The
    chain has its own error boundary, and an unexpected exception is answered 500 by uvicorn just as
    by that middleware, so skipping it changes nothing a client sees. The same routes stay in the
    router for anything the shortcut does not match exactly.
    """

    completions: ASGIApp | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (self.completions is not None and scope["type"] == "http" and scope["method"] == "POST"
                and scope["path"] in COMPLETION_PATHS):
            scope["app"] = self
            await self.completions(scope, receive, send)
            return
        await super().__call__(scope, receive, send)


def create_app(
    policy: Policy,
    upstream_url: str,
    *,
    tokenizer_path: str | None = None,
    drain: DrainState | None = None,
) -> Starlette:
    """Build the proxy. `drain` lets the server (or a test) start draining; one is created if absent."""
    metrics = ProxyMetrics(policy)
    drain = drain or DrainState()
    client = make_client(max_connections=policy.admission.max_inflight + 16)
    counter: TokenCounter = (
        LocalTokenCounter(tokenizer_path) if tokenizer_path else UpstreamTokenCounter(client, upstream_url)
    )
    chain: ASGIApp = Forwarder(client=client, upstream_url=upstream_url, metrics=metrics)
    window = BatchingWindow(chain, classes=policy.classes, metrics=metrics)
    chain = window
    admission = Admission(chain, policy=policy, metrics=metrics)
    chain = admission
    if policy.admission.tenant_tokens_per_minute is not None:
        chain = TenantRateLimit(chain, tokens_per_minute=policy.admission.tenant_tokens_per_minute, counter=counter)
    chain = OutputLength(chain, policy=policy.output_length, counter=counter, metrics=metrics)
    chain = JsonBody(chain, max_body_bytes=policy.output_length.max_body_bytes,
                     default_class=policy.admission.default_class)
    completions = ErrorBoundary(DrainGate(chain, drain=drain), metrics=metrics)
    passthrough = ErrorBoundary(
        DrainGate(PassThrough(client=client, upstream_url=upstream_url, metrics=metrics), drain=drain),
        metrics=metrics,
    )

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(request: Request) -> Response:
        if drain.draining:
            return Draining("the proxy is draining").to_response()
        if not await upstream_ready(client, upstream_url):
            return error_response(503, "the upstream engine is not ready", error_type="service_unavailable",
                                  code="upstream_not_ready", headers={"Retry-After": "1"})
        return JSONResponse({"status": "ready"})

    engine_metrics = EngineMetricsRelay(client, upstream_url)

    async def metrics_endpoint(request: Request) -> Response:
        # The engine's vllm:* series follow the proxy's own, for the operator's autoscaler (METRICS.md).
        return Response(metrics.render() + await engine_metrics.render(), media_type=CONTENT_TYPE)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return error_response(exc.status_code, exc.detail, error_type="invalid_request_error",
                              headers=exc.headers)

    async def method_not_allowed(request: Request) -> Response:
        return error_response(405, f"{request.method} is not allowed here; use POST",
                              error_type="invalid_request_error", headers={"Allow": "POST"})

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
    app = ProxyApp(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error})
    app.completions = completions
    app.state.policy = policy
    app.state.metrics = metrics
    app.state.drain = drain
    app.state.admission = admission
    app.state.window = window
    app.state.client = client
    app.state.engine_metrics = engine_metrics
    return app
