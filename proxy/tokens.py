"""Prompt token counting: the upstream's POST /tokenize, or a local `tokenizers` file when configured.

Only policies that need a count (maxInputTokens, the tenant token rate) ask for one, and the count is
cached on the request context so it is taken at most once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import httpx

from decodeservice.common.errors import BadRequest
from decodeservice.proxy.context import RequestContext
from decodeservice.proxy.errors import UpstreamUnavailable
from decodeservice.proxy.upstream_health import EngineKind


class TokenCounter(Protocol):
    async def count(self, body: dict[str, Any]) -> int: ...


def _prompt_parts(body: dict[str, Any]) -> tuple[list[str], int]:
    """Split a completion/chat body into texts to tokenize and an already-known token count."""
    if "messages" in body:
        messages = body["messages"]
        if not isinstance(messages, list):
            raise BadRequest("`messages` must be a list", param="messages", reason="invalid_field")
        texts: list[str] = []
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                texts.append(content)
            elif isinstance(content, list):
                texts.extend(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
        return texts, 0
    prompt = body.get("prompt", "")
    if isinstance(prompt, str):
        return [prompt], 0
    if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        return list(prompt), 0
    if isinstance(prompt, list) and all(isinstance(p, int) for p in prompt):
        return [], len(prompt)
    if isinstance(prompt, list) and all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in prompt):
        return [], sum(len(p) for p in prompt)
    raise BadRequest("`prompt` must be a string, a list of strings, or token ids", param="prompt",
                     reason="invalid_field")


# The chat request's fields that change what vLLM's chat template renders; its /tokenize takes the same
# ones (TokenizeChatRequest, tests/support/contracts/vllm/), so a request's tool definitions are counted.
# The builtin engine's /tokenize takes none of them (and its chat refuses tools).
TEMPLATE_FIELDS = {
    EngineKind.BUILTIN: (),
    EngineKind.VLLM: ("add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs",
                      "tools"),
}


class UpstreamTokenCounter:
    """Counts with the engine's own tokenizer and chat template (POST /tokenize)."""

    def __init__(self, client: httpx.AsyncClient, upstream_url: str, *,
                 engine_kind: EngineKind = EngineKind.BUILTIN):
        self._client = client
        self._url = upstream_url.rstrip("/") + "/tokenize"
        self._template_fields = TEMPLATE_FIELDS[engine_kind]

    async def count(self, body: dict[str, Any]) -> int:
        if "messages" in body:
            _prompt_parts(body)  # validates the shape before it goes upstream
            payload = {"messages": body["messages"]}
            payload.update((f, body[f]) for f in self._template_fields if body.get(f) is not None)
            return await self._tokenize(payload)
        texts, known = _prompt_parts(body)
        for text in texts:
            known += await self._tokenize({"prompt": text})
        return known

    async def _tokenize(self, payload: dict[str, Any]) -> int:
        try:
            response = await self._client.post(self._url, json=payload)
        except httpx.HTTPError as exc:
            raise UpstreamUnavailable(f"cannot count prompt tokens: upstream unreachable ({exc})",
                                      headers={"Retry-After": "1"}) from None
        if response.status_code >= 500:
            raise UpstreamUnavailable(f"upstream /tokenize failed with {response.status_code}",
                                      headers={"Retry-After": "1"})
        try:
            data = response.json()
        except ValueError:
            data = None
        if response.status_code >= 400 or not isinstance(data, dict) or not isinstance(data.get("count"), int):
            raise BadRequest(f"upstream could not tokenize the prompt (HTTP {response.status_code})",
                             reason="tokenize_failed")
        count: int = data["count"]
        return count


class LocalTokenCounter:
    """Counts with a `tokenizers` JSON file; chat messages are counted by content (no chat template)."""

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(path))

    async def count(self, body: dict[str, Any]) -> int:
        texts, known = _prompt_parts(body)
        return known + sum(len(e.ids) for e in self._tokenizer.encode_batch(texts, add_special_tokens=False))


async def prompt_tokens(ctx: RequestContext, counter: TokenCounter) -> int:
    if ctx.prompt_tokens is None:
        ctx.prompt_tokens = await counter.count(ctx.body)
    return ctx.prompt_tokens
