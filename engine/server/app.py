"""The engine's HTTP API: OpenAI completions and chat, /tokenize, /health, /ready, /metrics.

    app = build_app(settings, engine_factory=lambda: Engine.from_pretrained("smollm2-135m"))

The model loads in the background after the server starts listening, so probes can ask: /health is
200 while the process and engine loop live, /ready only once a warm-up generation has run. The
generation routes live in generation.py, what every route shares in state.py.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from decodeservice.common.errors import (
    OpenAIError,
    ServerError,
    ServiceUnavailable,
    http_exception_handler,
    openai_error_handler,
)
from decodeservice.common.lifecycle import Phase
from decodeservice.engine.async_engine import AsyncEngine
from decodeservice.engine.engine import Engine
from decodeservice.engine.sampling_params import SamplingParams
from decodeservice.engine.server.generation import chat_completions, completions, engine_stream
from decodeservice.engine.server.metrics import CONTENT_TYPE
from decodeservice.engine.server.protocol import TokenizeRequest
from decodeservice.engine.server.settings import ServerSettings
from decodeservice.engine.server.state import ServerState, parse

log = logging.getLogger("decodeservice.engine.server")
WARMUP_PROMPT = "Hello"


# -- other routes ----------------------------------------------------------------------------------
async def models(request: Request) -> Response:
    state: ServerState = request.app.state.server
    card: dict[str, Any] = {"id": state.settings.served_model_name, "object": "model", "created": 0,
                            "owned_by": "decodeservice"}
    if state.aengine is not None:
        card["max_model_len"] = state.aengine.engine.max_model_len
        engine = state.aengine.engine
        card["kv_cache_dtype"] = str(engine.kv_dtype).removeprefix("torch.")
        card["kv_cache_dtype_reason"] = engine.kv_dtype_reason
        card["deterministic"] = engine.config.deterministic  # every row on its one path (EngineConfig.deterministic)
        if (plan := engine.plan.kernels) is not None:
            card["kernels"] = plan.describe()  # which CPU kernels this machine runs, and why
        card["attention"] = engine.plan.attention.describe()  # CPU: whether the native kernel reads the pool
        card["plan"] = engine.plan.describe()  # every machine-dependent choice, as `decodectl engine --explain-plan`
        if engine.spec is not None:  # measured at start-up unless configured: what sets the drafts' k
            spec = engine.spec
            card["speculative"] = {"method": spec.config.method, "draft_row_cost": round(spec.row_cost, 4),
                                   "draft_row_cost_source": "configured" if spec.config.draft_row_cost is not None
                                   else "measured", "disable_batch_size": spec.config.disable_batch_size,
                                   # from what acceptance a draft pays, per batch size (spec_decode/policy.py)
                                   "break_even_acceptance": {str(b): round(a, 3) for b in spec.batch_sizes()
                                                             if (a := spec.break_even_acceptance(b)) is not None}}
    return JSONResponse({"object": "list", "data": [card]})


async def tokenize(request: Request) -> Response:
    state: ServerState = request.app.state.server
    req = await parse(request, TokenizeRequest, state.settings.max_body_bytes)
    state.check_model(req.model)
    if state.aengine is None:
        raise ServiceUnavailable("the model is still loading", code="not_ready")
    tokenizer = state.aengine.tokenizer
    if req.messages is not None:
        text = tokenizer.apply_chat_template([{"role": "system" if m.role == "developer" else m.role,
                                               "content": m.text()} for m in req.messages],
                                             add_generation_prompt=req.add_generation_prompt)
        ids = tokenizer.encode(text, add_special_tokens=bool(req.add_special_tokens))
    else:
        assert req.prompt is not None
        special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = tokenizer.encode(req.prompt, add_special_tokens=special)
    return JSONResponse({"count": len(ids), "max_model_len": state.aengine.engine.max_model_len, "tokens": ids})


async def health(request: Request) -> Response:
    state: ServerState = request.app.state.server
    if state.lifecycle.phase is Phase.FAILED:
        return JSONResponse({"status": "failed", "error": state.lifecycle.failure}, status_code=503)
    if state.aengine is not None and not state.aengine.is_alive:
        return JSONResponse({"status": "dead", "error": repr(state.aengine.dead_error)}, status_code=503)
    return JSONResponse({"status": "ok" if state.aengine is not None else "loading"})


async def ready(request: Request) -> Response:
    state: ServerState = request.app.state.server
    alive = state.aengine is not None and state.aengine.is_alive
    if state.lifecycle.ready and alive:
        return JSONResponse({"status": "ready"})
    status = state.lifecycle.phase.value if state.lifecycle.phase is not Phase.READY else "dead"
    return JSONResponse({"status": status}, status_code=503)


async def metrics(request: Request) -> Response:
    state: ServerState = request.app.state.server
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)


# -- errors ----------------------------------------------------------------------------------------
async def _unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error in %s %s", request.method, request.url.path)
    return ServerError(f"internal error: {exc!r}", code="internal_error").to_response()


# -- the app ---------------------------------------------------------------------------------------
async def _load(state: ServerState, engine_factory: Callable[[], Engine], stop: Callable[[], None]) -> None:
    try:
        aengine = await AsyncEngine.launch(engine_factory)
        state.aengine = aengine
        warmup = SamplingParams(max_tokens=1, temperature=0.0)
        async with aclosing(engine_stream(aengine, WARMUP_PROMPT, warmup, request_id="warmup")) as stream:
            async for _ in stream:
                pass
    except Exception as exc:  # any load failure ends the server with a clear log line
        log.error("the model failed to load: %s", exc)
        state.lifecycle.mark_failed(str(exc))
        state.exit_code = 1
        stop()
        return
    log.info("model loaded and warm; ready")
    state.lifecycle.mark_ready()


def build_app(settings: ServerSettings, *, engine_factory: Callable[[], Engine],
              stop: Callable[[], None] | None = None) -> Starlette:
    """`stop` asks the HTTP server to exit after a failed load (the server itself runs the drain)."""
    state = ServerState(settings)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        state.lifecycle.bind(asyncio.get_running_loop())
        load = asyncio.create_task(_load(state, engine_factory, stop or (lambda: None)))
        try:
            yield
        finally:
            load.cancel()
            await asyncio.gather(load, return_exceptions=True)
            if state.aengine is not None:
                await asyncio.to_thread(state.aengine.shutdown)

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    handlers = {OpenAIError: openai_error_handler, HTTPException: http_exception_handler, Exception: _unexpected}
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers=handlers)
    app.state.server = state
    return app
