"""Output length policy: cap `max_tokens` / `max_completion_tokens`, inject a default, bound the prompt.

clamp: a limit above `maxOutputTokens` is rewritten down to it, and the response carries
`x-decode-clamped: <original>`. reject: it is answered 400. No limit at all: `defaultMaxTokens` is
injected as `max_tokens`, so no request can run to the context length by omission. With
`maxInputTokens`, the prompt is counted (upstream /tokenize or a local tokenizer) and 400 when over.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from decodeservice.proxy.context import get_context
from decodeservice.proxy.metrics import ProxyMetrics
from decodeservice.proxy.policy import LengthMode, OutputLengthPolicy
from decodeservice.proxy.tokens import TokenCounter, prompt_tokens
from decodeservice.serving.errors import BadRequest

CLAMPED_HEADER = b"x-decode-clamped"
LIMIT_FIELDS = ("max_tokens", "max_completion_tokens")


class OutputLength:
    def __init__(
        self, app: ASGIApp, *, policy: OutputLengthPolicy, counter: TokenCounter, metrics: ProxyMetrics
    ):
        self.app = app
        self.policy = policy
        self.counter = counter
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        ctx = get_context(scope)
        cap = self.policy.max_output_tokens
        given: dict[str, int] = {}
        for field in LIMIT_FIELDS:
            value = ctx.body.get(field)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise BadRequest(f"`{field}` must be a non-negative integer", param=field, reason="invalid_field")
            given[field] = value
        if not given:
            ctx.body["max_tokens"] = self.policy.default_max_tokens
            ctx.body_rewritten = True
            ctx.max_tokens = self.policy.default_max_tokens
        else:
            over = {f: v for f, v in given.items() if v > cap}
            if over and self.policy.mode is LengthMode.REJECT:
                field, value = next(iter(over.items()))
                raise BadRequest(f"`{field}` is {value}, above this deployment's limit of {cap} output tokens",
                                 param=field, reason="max_tokens")
            for field in over:
                ctx.body[field] = cap
            if over:
                ctx.body_rewritten = True
                ctx.clamped_from = max(over.values())
                self.metrics.for_class[ctx.priority].clamped.inc()
            # What the engine obeys: max_completion_tokens when set and non-zero, else max_tokens (vLLM's
            # get_max_tokens; the builtin engine's protocol too), so the tenant rate charges the real limit.
            limit = given.get("max_completion_tokens") or given.get("max_tokens", 0)
            ctx.max_tokens = min(limit, cap)
        if self.policy.max_input_tokens is not None:
            n = await prompt_tokens(ctx, self.counter)
            if n > self.policy.max_input_tokens:
                raise BadRequest(
                    f"the prompt has {n} tokens, above this deployment's limit of "
                    f"{self.policy.max_input_tokens} input tokens",
                    param="messages" if "messages" in ctx.body else "prompt", reason="input_too_long",
                )
        if ctx.clamped_from is not None:
            ctx.response_headers.append((CLAMPED_HEADER, str(ctx.clamped_from).encode()))
        await self.app(scope, receive, send)
