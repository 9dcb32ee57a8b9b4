"""Output length policy: cap `max_tokens` / `max_completion_tokens`, inject a default, bound the prompt.

clamp: the limit the engine obeys (on a chat `max_completion_tokens` when given, else `max_tokens`) above
`maxOutputTokens` is rewritten down to it (so is the other field when over), and the response carries
`x-decode-clamped: <original>`. reject: it is answered 400. No limit the engine obeys: `defaultMaxTokens`
is injected as `max_tokens`, so no request runs to the context length (or to vLLM's default of 16 on a
completion) by omission. With `maxInputTokens`, the prompt is counted (upstream /tokenize or a local
tokenizer) and 400 when over.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from decodeservice.common.errors import BadRequest
from decodeservice.proxy.context import get_context
from decodeservice.proxy.metrics import ProxyMetrics
from decodeservice.proxy.policy import LengthMode, OutputLengthPolicy
from decodeservice.proxy.tokens import TokenCounter, prompt_tokens

CLAMPED_HEADER = b"x-decode-clamped"
LIMIT_FIELDS = ("max_tokens", "max_completion_tokens")
COMPLETIONS_PATH = "/v1/completions"  # the other completion route is the chat one


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
        # The limit the engine obeys: on a chat, max_completion_tokens whenever it is given (0 included),
        # else max_tokens (vLLM's chat serving from 0.30 on, and the builtin engine's protocol); a
        # completion reads max_tokens alone (neither engine has max_completion_tokens there). Clamping,
        # rejecting and the tenant rate's charge follow that one; the other field, when over the cap, is
        # lowered too without counting as a clamp (an engine reading it must not exceed the cap).
        chat = scope["path"] != COMPLETIONS_PATH
        field = "max_completion_tokens" if chat and "max_completion_tokens" in given else "max_tokens"
        for name, value in given.items():
            if name != field and value > cap:
                ctx.body[name] = cap
                ctx.body_rewritten = True
        if field not in given:
            ctx.body["max_tokens"] = self.policy.default_max_tokens
            ctx.body_rewritten = True
            ctx.max_tokens = self.policy.default_max_tokens
        else:
            limit = given[field]
            if limit > cap and self.policy.mode is LengthMode.REJECT:
                raise BadRequest(f"`{field}` is {limit}, above this deployment's limit of {cap} output tokens",
                                 param=field, reason="max_tokens")
            if limit > cap:
                ctx.body[field] = cap
                ctx.body_rewritten = True
                ctx.clamped_from = limit
                self.metrics.for_class[ctx.priority].clamped.inc()
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
