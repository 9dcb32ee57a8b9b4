"""The router app: routes, the error boundary, the background endpoint source and poller.

POST /v1/completions and /v1/chat/completions go through

    ErrorBoundary (the proxy's) > DrainGate > JsonBody (413/400, the proxy's) > Dispatcher

(straight from the ASGI entry, as the proxy's own completion routes: `ProxyApp`). GET /v1/models goes to
any ready endpoint; /health, /ready and /metrics are the router's own. /ready is
200 even with no endpoint: the router then holds requests, which is what lets a service scale to zero.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from decodeservice.common.errors import Draining, ServiceUnavailable, http_exception_handler
from decodeservice.common.lifecycle import Lifecycle, Phase
from decodeservice.proxy.app import COMPLETION_PATHS, DrainGate, ErrorBoundary, ProxyApp
from decodeservice.proxy.request_body import JsonBody
from decodeservice.proxy.streaming import UpstreamTimeouts, relay
from decodeservice.proxy.upstream import forward_headers, make_client
from decodeservice.router.config import RouterConfig
from decodeservice.router.dispatch import Dispatcher
from decodeservice.router.endpoints import EndpointSource
from decodeservice.router.fleet import Fleet
from decodeservice.router.metrics import CONTENT_TYPE, RouterMetrics
from decodeservice.router.prefix_index import PrefixIndex

_CONNECTIONS_PER_ENDPOINT = 256


class ModelsForwarder:
    """GET /v1/models from the first ready endpoint that answers (every pod serves the same model)."""

    def __init__(self, *, fleet: Fleet, client: httpx.AsyncClient) -> None:
        self.fleet = fleet
        self.client = client

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        for url in self.fleet.ready_urls():
            request = self.client.build_request("GET", url + "/v1/models", headers=forward_headers(scope))
            try:
                response = await self.client.send(request, stream=True)
            except httpx.HTTPError:
                self.fleet.mark_unready(url)
                continue
            try:
                await relay(response, receive=receive, send=send, meter=None)
            finally:
                await response.aclose()
            return
        await ServiceUnavailable("no endpoint is ready", code="no_ready_endpoint",
                                 headers={"Retry-After": "1"}).to_response()(scope, receive, send)


def create_app(config: RouterConfig, source: EndpointSource, *, lifecycle: Lifecycle | None = None) -> ProxyApp:
    lifecycle = lifecycle or Lifecycle(phase=Phase.READY)
    metrics = RouterMetrics()
    fleet = Fleet(index=PrefixIndex(max_blocks_per_endpoint=config.max_blocks_per_endpoint),
                  scrape_interval_s=config.scrape_interval_s)
    client = make_client(max_connections=_CONNECTIONS_PER_ENDPOINT)
    slo = config.policy.slo
    timeouts = UpstreamTimeouts(
        first_token_s=None if slo.first_token_timeout_ms is None else slo.first_token_timeout_ms / 1000,
        stall_s=None if slo.stream_stall_timeout_ms is None else slo.stream_stall_timeout_ms / 1000,
    )
    dispatcher = Dispatcher(config=config, fleet=fleet, client=client, metrics=metrics, timeouts=timeouts)
    chain = JsonBody(dispatcher, max_body_bytes=config.policy.output_length.max_body_bytes,
                     default_class=config.policy.admission.default_class)
    completions = ErrorBoundary(DrainGate(chain, lifecycle=lifecycle),
                                count_answer=lambda cls, status: metrics.requests.labels(cls, str(status)).inc())

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(request: Request) -> Response:
        if lifecycle.draining:
            return Draining("the router is draining").to_response()
        return JSONResponse({"status": "ready", "endpoints_ready": len(fleet.ready_urls())})

    async def metrics_endpoint(request: Request) -> Response:
        body = metrics.render(ready=len(fleet.ready_urls()), known=len(fleet.endpoints))
        return Response(body, media_type=CONTENT_TYPE)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        tasks = [asyncio.create_task(source.run(fleet.update), name="router-endpoints"),
                 asyncio.create_task(fleet.poll_forever(client), name="router-poller")]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await client.aclose()

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        Route("/v1/models", ModelsForwarder(fleet=fleet, client=client), methods=["GET"]),
        *(Route(path, completions, methods=["POST"]) for path in COMPLETION_PATHS),
    ]
    router = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_exception_handler})
    # The proxy's shortcut: completion POSTs skip Starlette's middleware, which wraps `send` once per
    # chunk of every stream (proxy/app.py's ProxyApp says more); the rest is routed as before.
    app = ProxyApp(router, completions=completions)
    app.state.config = config
    app.state.fleet = fleet
    app.state.metrics = metrics
    app.state.lifecycle = lifecycle
    app.state.dispatcher = dispatcher
    return app
