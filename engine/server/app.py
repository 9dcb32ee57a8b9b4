"""The engine's HTTP API: OpenAI completions and chat, /tokenize, /health, /ready, /metrics.

    app = build_app(settings, engine_factory=lambda: Engine.from_pretrained("smollm2-135m"))

The model loads in the background after the server starts listening, so probes can ask: /health is
200 while the process and engine loop live, /ready only once a warm-up generation has run.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from typing import Any, TypeVar, cast

from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from decodeservice.common.body import read_body
from decodeservice.common.errors import (
    BadRequest,
    Draining,
    NotFound,
    OpenAIError,
    ServerError,
    ServiceUnavailable,
    http_exception_handler,
    openai_error_handler,
)
from decodeservice.common.lifecycle import Lifecycle, Phase
from decodeservice.engine.async_engine import AsyncEngine
from decodeservice.engine.engine import EncodedPrompt, Engine
from decodeservice.engine.errors import EngineDeadError, EngineError, InvalidRequestError, PromptTooLongError
from decodeservice.engine.outputs import EngineStats, RequestOutput
from decodeservice.engine.sampling_params import SamplingParams
from decodeservice.engine.server import openai_format as fmt
from decodeservice.engine.server.metrics import CONTENT_TYPE, ServerMetrics
from decodeservice.engine.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeRequest,
    from_validation_error,
)
from decodeservice.engine.server.settings import ServerSettings
from decodeservice.engine.server.streaming import DONE, EventStreamResponse, sse, text_event_encoder

log = logging.getLogger("decodeservice.engine.server")
M = TypeVar("M", bound=BaseModel)
WARMUP_PROMPT = "Hello"


class ServerState:
    """Everything the routes share; one per app."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.lifecycle = Lifecycle()
        self.aengine: AsyncEngine | None = None
        self.metrics = ServerMetrics(model_name=settings.served_model_name, stats=self._stats)
        self.exit_code = 0

    def _stats(self) -> EngineStats | None:
        return self.aengine.stats() if self.aengine is not None else None

    def engine_for_request(self) -> AsyncEngine:
        phase = self.lifecycle.phase
        if phase is Phase.DRAINING:
            raise Draining()
        if self.aengine is None or phase is not Phase.READY:
            raise ServiceUnavailable("the model is still loading" if phase is Phase.LOADING else
                                     f"the model failed to load: {self.lifecycle.failure}", code="not_ready")
        if not self.aengine.is_alive:
            raise ServerError(f"the engine loop has died: {self.aengine.dead_error!r}", code="engine_dead")
        return self.aengine

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.settings.served_model_name:
            raise NotFound(f"the model `{model}` does not exist; this server serves "
                           f"`{self.settings.served_model_name}`", param="model", code="model_not_found")


# -- request parsing -------------------------------------------------------------------------------
async def parse(request: Request, model: type[M], limit: int) -> M:
    body = await read_body(request.receive, limit=limit, content_length=request.headers.get("content-length"))
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        error = from_validation_error(exc)
        if exc.errors()[0]["type"] == "json_invalid":
            error = BadRequest(f"the body is not valid JSON: {exc.errors()[0]['msg']}", code="invalid_json")
        raise error from None


def engine_error(exc: EngineError) -> OpenAIError:
    if isinstance(exc, PromptTooLongError):
        return BadRequest(str(exc), param=exc.param, code="context_length_exceeded")
    if isinstance(exc, InvalidRequestError):
        return BadRequest(str(exc), param=exc.param, code="invalid_value")
    if isinstance(exc, EngineDeadError):
        return ServerError(str(exc), code="engine_dead")
    return ServerError(f"engine error: {exc}", code="engine_error")


# -- generation ------------------------------------------------------------------------------------
class Generation:
    """One accepted request: validated, tokenized, ready to run."""

    def __init__(self, state: ServerState, aengine: AsyncEngine, *, prompt: EncodedPrompt,
                 params: SamplingParams, priority: int, meta: fmt.ResponseMeta,
                 cache_salt: str | None = None) -> None:
        self.state = state
        self.aengine = aengine
        self.prompt = prompt
        self.params = params
        self.priority = priority
        self.cache_salt = cache_salt
        self.meta = meta

    async def outputs(self) -> AsyncGenerator[RequestOutput, None]:
        aengine = self.aengine
        tracker = self.state.metrics.tracker()
        with self.state.lifecycle.track():
            try:
                # aclosing: leaving early must close the engine's stream, which aborts the request.
                async with aclosing(_stream(aengine, self.prompt, self.params, request_id=self.meta.id,
                                            priority=self.priority, cache_salt=self.cache_salt)) as stream:
                    async for out in stream:
                        tracker.observe(out)
                        yield out
            finally:
                tracker.aborted()

    async def final(self) -> RequestOutput:
        """Run to the end; the finished output, which carries the totals."""
        last: RequestOutput | None = None
        async with aclosing(self.outputs()) as outputs:
            async for out in outputs:
                last = out
        assert last is not None and last.finished
        return last


def _stream(aengine: AsyncEngine, prompt: str | EncodedPrompt, params: SamplingParams, *, request_id: str,
            priority: int = 0, cache_salt: str | None = None) -> AsyncGenerator[RequestOutput, None]:
    # AsyncEngine.generate is an async generator; typed as one so it can be aclose()d.
    return cast(AsyncGenerator[RequestOutput, None],
                aengine.generate(prompt, params, request_id=request_id, priority=priority, cache_salt=cache_salt))


def _encode(aengine: AsyncEngine, prompt: str | list[int], *, add_special_tokens: bool,
            req: CompletionRequest | ChatCompletionRequest) -> EncodedPrompt:
    """The server's edge: the prompt is checked here, once, before the response starts (so bad input
    is a 400, not an error event in a stream); the engine takes the `EncodedPrompt` as it is."""
    try:
        if req.truncate_prompt_tokens is not None:
            ids = aengine.tokenizer.encode(prompt, add_special_tokens=add_special_tokens) \
                if isinstance(prompt, str) else list(prompt)
            prompt = req.truncate(ids, aengine.engine.max_model_len)
        return aengine.encode(prompt, add_special_tokens=add_special_tokens)
    except EngineError as exc:
        raise engine_error(exc) from None


async def completions(request: Request) -> Response:
    state: ServerState = request.app.state.server
    req = await parse(request, CompletionRequest, state.settings.max_body_bytes)
    state.check_model(req.model)
    prompt = req.single_prompt()
    aengine = state.engine_for_request()
    encoded = _encode(aengine, prompt, add_special_tokens=True, req=req)
    max_tokens = req.max_tokens or state.settings.default_completion_max_tokens
    gen = _generation(state, aengine, req, encoded, max_tokens=max_tokens, logprobs=req.logprobs, kind="completion")
    return await _respond(request, gen, stream=req.stream, include_usage=req.include_usage,
                          want_logprobs=req.logprobs is not None)


async def chat_completions(request: Request) -> Response:
    state: ServerState = request.app.state.server
    req = await parse(request, ChatCompletionRequest, state.settings.max_body_bytes)
    state.check_model(req.model)
    aengine = state.engine_for_request()
    try:
        text = aengine.tokenizer.apply_chat_template(req.conversation(),
                                                     add_generation_prompt=req.add_generation_prompt)
    except EngineError as exc:
        raise BadRequest(f"cannot render the chat: {exc}", param="messages", code="invalid_value") from None
    # A rendered chat template already holds the special tokens (vLLM's add_special_tokens default).
    encoded = _encode(aengine, text, add_special_tokens=req.add_special_tokens, req=req)
    # Like vLLM: without a limit, a chat answer may use the rest of the context.
    max_tokens = req.requested_max_tokens or aengine.engine.max_model_len - len(encoded.token_ids)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    gen = _generation(state, aengine, req, encoded, max_tokens=max_tokens, logprobs=logprobs, kind="chat")
    return await _respond(request, gen, stream=req.stream, include_usage=req.include_usage,
                          want_logprobs=req.logprobs)


def _generation(state: ServerState, aengine: AsyncEngine, req: CompletionRequest | ChatCompletionRequest,
                prompt: EncodedPrompt, *,
                max_tokens: int, logprobs: int | None, kind: fmt.Kind) -> Generation:
    try:
        params = req.sampling_params(max_tokens=max_tokens, logprobs=logprobs)
        params.check_vocab(aengine.engine.model_config.vocab_size)
    except InvalidRequestError as exc:
        raise engine_error(exc) from None
    prefix = "cmpl" if kind == "completion" else "chatcmpl"
    meta = fmt.ResponseMeta.new(request_id=f"{prefix}-{uuid.uuid4().hex}", model=state.settings.served_model_name,
                                kind=kind)
    return Generation(state, aengine, prompt=prompt, params=params, priority=req.priority, meta=meta,
                      cache_salt=req.cache_salt)


async def _respond(request: Request, gen: Generation, *, stream: bool, include_usage: bool,
                   want_logprobs: bool) -> Response:
    if stream:
        return EventStreamResponse(_events(gen, include_usage=include_usage, want_logprobs=want_logprobs))
    # Nothing cancels a plain handler when its client leaves, so watch for that ourselves.
    work = asyncio.ensure_future(gen.final())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, gone):
            task.cancel()  # cancelling `work` closes the engine stream, which aborts the request
        await asyncio.gather(work, gone, return_exceptions=True)
    if work.cancelled():
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
    try:
        final = work.result()
    except EngineError as exc:
        raise engine_error(exc) from None
    logprobs = None
    if want_logprobs:
        entries = final.logprobs or []
        tok = gen.aengine.tokenizer
        logprobs = fmt.completion_logprobs(tok, entries, offset=0) if gen.meta.kind == "completion" \
            else fmt.chat_logprobs(tok, entries)
    return JSONResponse(fmt.full_response(gen.meta, final, logprobs=logprobs))


async def _disconnected(request: Request) -> None:
    # The body has been read, so the next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _events(gen: Generation, *, include_usage: bool, want_logprobs: bool) -> AsyncGenerator[bytes, None]:
    meta, chat = gen.meta, gen.meta.kind == "chat"
    tok = gen.aengine.tokenizer
    offset = 0
    final: RequestOutput | None = None
    text_event = text_event_encoder(lambda text: fmt.chunk(meta, text=text, include_usage_field=include_usage))
    try:
        if chat:
            yield sse(fmt.chunk(meta, text="", role=True, include_usage_field=include_usage))
        async with aclosing(gen.outputs()) as outputs:
            async for out in outputs:
                final = out
                if out.new_text and not out.finished and not want_logprobs:
                    offset += len(out.new_text)
                    yield text_event(out.new_text)  # most chunks: text alone
                    continue
                entries = (out.new_logprobs or []) if want_logprobs else []
                if not (out.new_text or out.finished or entries):
                    continue  # the detokenizer is holding text back (partial character or stop string)
                logprobs = None
                if want_logprobs:
                    logprobs = fmt.chat_logprobs(tok, entries) if chat else \
                        fmt.completion_logprobs(tok, entries, offset=offset)
                offset += len(out.new_text)
                text = out.new_text if out.new_text or not chat else None
                yield sse(fmt.chunk(meta, text=text, finish_reason=out.finish_reason if out.finished else None,
                                    logprobs=logprobs, include_usage_field=include_usage))
        if include_usage and final is not None:
            yield sse(fmt.usage_chunk(meta, final))
    except (EngineError, OpenAIError) as exc:
        error = exc if isinstance(exc, OpenAIError) else engine_error(exc)
        yield sse(error.body())  # the status line is long gone: the error travels as an event
    yield DONE


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
        engine = await asyncio.to_thread(engine_factory)
        aengine = AsyncEngine(engine)
        aengine.start()
        state.aengine = aengine
        warmup = SamplingParams(max_tokens=1, temperature=0.0)
        async with aclosing(_stream(aengine, WARMUP_PROMPT, warmup, request_id="warmup")) as stream:
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
