"""OpenAI request models; their errors are `decodeservice.serving.errors` (OpenAI error JSON).

Requests are pydantic models with `extra="forbid"`: a field we do not implement is a 400 naming that
field, never silently ignored. Fields we accept only at their neutral value (`n=1`, `echo=false`, ...)
are declared and checked, so the error says what is unsupported rather than "extra field".
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from decodeservice.engine.sampling_params import SamplingParams
from decodeservice.serving.errors import BadRequest

MAX_LOGPROBS = 20
MAX_CACHE_SALT_CHARS = 256


def unsupported(param: str, detail: str) -> BadRequest:
    return BadRequest(f"{param}: {detail} is not supported by this server", param=param,
                      code="unsupported_parameter")


def from_validation_error(exc: ValidationError) -> BadRequest:
    """The first pydantic error, as OpenAI reports it: one message and the offending parameter."""
    first = exc.errors(include_url=False)[0]
    param = ".".join(str(part) for part in first["loc"]) or None
    if first["type"] == "extra_forbidden":
        return BadRequest(f"unsupported parameter {param!r}", param=param, code="unsupported_parameter")
    message = first["msg"].removeprefix("Value error, ")
    return BadRequest(f"{param}: {message}" if param else message, param=param, code="invalid_value")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False


class _SamplingRequest(BaseModel):
    """Fields shared by both endpoints."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(default=0, ge=0)  # vLLM extension
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # accepted, used for nothing
    ignore_eos: bool = False  # vLLM extension; benchmarks use it to fix output lengths
    priority: int = 0  # vLLM extension; lower runs first
    # vLLM extension: only requests with the same salt share cached prefixes (per-tenant isolation).
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return value

    def _check_common(self) -> None:
        if self.n != 1:
            raise unsupported("n", f"n={self.n}")
        if self.presence_penalty or self.frequency_penalty:
            name = "presence_penalty" if self.presence_penalty else "frequency_penalty"
            raise unsupported(name, "a non-zero penalty")
        if self.logit_bias:
            raise unsupported("logit_bias", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise BadRequest("stream_options is only allowed when stream is true", param="stream_options",
                             code="invalid_value")

    def sampling_params(self, *, max_tokens: int, logprobs: int | None) -> SamplingParams:
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, seed=self.seed, stop=tuple(stops), ignore_eos=self.ignore_eos,
                              logprobs=logprobs)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _checks(self) -> CompletionRequest:
        self._check_common()
        if self.echo:
            raise unsupported("echo", "echo=true")
        if self.suffix:
            raise unsupported("suffix", "suffix")
        if self.best_of not in (None, 1):
            raise unsupported("best_of", f"best_of={self.best_of}")
        return self

    def single_prompt(self) -> str | list[int]:
        """One prompt: a string or a list of token ids. A batch of prompts is refused."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return prompt
        if prompt and all(isinstance(p, int) for p in prompt):
            return prompt  # type: ignore[return-value]
        if len(prompt) == 1:
            return prompt[0]  # type: ignore[return-value]
        raise unsupported("prompt", "a batch of several prompts (send one request per prompt)")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _checks(self) -> ChatCompletionRequest:
        self._check_common()
        if self.tools:
            raise unsupported("tools", "tool calling")
        if self.tool_choice not in (None, "none"):
            raise unsupported("tool_choice", "tool calling")
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise unsupported("response_format", "structured output")
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequest("top_logprobs needs logprobs=true", param="top_logprobs", code="invalid_value")
        return self

    def conversation(self) -> list[dict[str, str]]:
        # Chat templates written before the "developer" role know it as "system".
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in self.messages]

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the chat template."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self
