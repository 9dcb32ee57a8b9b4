"""The generation routes, /v1/completions and /v1/chat/completions: a request is checked and tokenized
at the edge (bad input is a 400 before any response starts), then streamed as SSE or answered whole."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import cast

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from decodeservice.common.errors import BadRequest, OpenAIError
from decodeservice.engine.async_engine import AsyncEngine
from decodeservice.engine.engine import EncodedPrompt
from decodeservice.engine.errors import EngineError, InvalidRequestError
from decodeservice.engine.outputs import RequestOutput
from decodeservice.engine.sampling_params import SamplingParams
from decodeservice.engine.server import openai_format as fmt
from decodeservice.engine.server.protocol import ChatCompletionRequest, CompletionRequest
from decodeservice.engine.server.state import ServerState, engine_error, parse
from decodeservice.engine.server.streaming import DONE, EventStreamResponse, sse, text_event_encoder


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
                async with aclosing(engine_stream(aengine, self.prompt, self.params, request_id=self.meta.id,
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


def engine_stream(aengine: AsyncEngine, prompt: str | EncodedPrompt, params: SamplingParams, *, request_id: str,
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
