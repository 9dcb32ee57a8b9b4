"""OpenAI response bodies: completions and chat, whole or as stream chunks.

Pure functions from engine outputs to dicts, so the shapes are testable without a server.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal

from decodeservice.engine.outputs import RequestOutput, TokenLogprob
from decodeservice.engine.tokenizer import Tokenizer

Kind = Literal["completion", "chat"]


@dataclass(frozen=True, kw_only=True)
class ResponseMeta:
    """What every chunk of one response repeats."""

    id: str
    model: str
    kind: Kind
    created: int

    @classmethod
    def new(cls, *, request_id: str, model: str, kind: Kind) -> ResponseMeta:
        return cls(id=request_id, model=model, kind=kind, created=int(time.time()))

    def envelope(self, *, chunk: bool) -> dict[str, Any]:
        if self.kind == "completion":
            obj = "text_completion"
        else:
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


def usage(final: RequestOutput) -> dict[str, Any]:
    """The finished output's token counts. `cached_tokens`: prompt tokens served from the prefix cache
    (whole blocks), as OpenAI and vLLM report them."""
    prompt, completion = len(final.prompt_token_ids), final.num_output_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": final.metrics.num_cached_tokens}}


def completion_logprobs(tokenizer: Tokenizer, entries: list[TokenLogprob], *, offset: int) -> dict[str, Any]:
    tokens = [_piece(tokenizer, e.token_id) for e in entries]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{_piece(tokenizer, t): lp for t, lp in e.top.items()} for e in entries],
        "text_offset": offsets,
    }


def chat_logprobs(tokenizer: Tokenizer, entries: list[TokenLogprob]) -> dict[str, Any]:
    def item(token_id: int, logprob: float) -> dict[str, Any]:
        piece = _piece(tokenizer, token_id)
        return {"token": piece, "logprob": logprob, "bytes": list(piece.encode())}

    return {"content": [
        {**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top.items()]}
        for e in entries
    ]}


def _piece(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def full_response(meta: ResponseMeta, final: RequestOutput, *, logprobs: dict[str, Any] | None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "logprobs": logprobs, "finish_reason": final.finish_reason}
    if meta.kind == "completion":
        choice["text"] = final.text
    else:
        choice["message"] = {"role": "assistant", "content": final.text}
    return {**meta.envelope(chunk=False), "choices": [choice], "usage": usage(final)}


def chunk(meta: ResponseMeta, *, text: str | None, finish_reason: str | None = None,
          logprobs: dict[str, Any] | None = None, role: bool = False,
          usage_: dict[str, Any] | None = None, include_usage_field: bool = False) -> dict[str, Any]:
    """One stream chunk. Chat puts `text` in `delta`; `text=None` leaves the delta empty."""
    choice: dict[str, Any] = {"index": 0, "logprobs": logprobs, "finish_reason": finish_reason}
    if meta.kind == "completion":
        choice["text"] = text or ""
    else:
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        choice["delta"] = delta
    body = {**meta.envelope(chunk=True), "choices": [choice]}
    if include_usage_field:
        body["usage"] = usage_  # with stream_options.include_usage every chunk carries the field
    return body


def usage_chunk(meta: ResponseMeta, final: RequestOutput) -> dict[str, Any]:
    """The last chunk when `stream_options.include_usage` is set: no choices, the totals."""
    return {**meta.envelope(chunk=True), "choices": [], "usage": usage(final)}
