"""OpenAI request models; their errors are `decodeservice.common.errors` (OpenAI error JSON).

Requests are pydantic models with `extra="forbid"`: a field we do not implement is a 400 naming that
field, never silently ignored. Fields we accept only at their neutral value (`n=1`, `echo=false`, ...)
are declared and checked, so the error says what is unsupported rather than "extra field".
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from decodeservice.common.errors import BadRequest
from decodeservice.engine.sampling_params import SamplingParams

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
    """Fields shared by both endpoints: OpenAI's, then vLLM's extensions (docs/engines.md#sampling-fields
    lists each one as implemented, or accepted only at its neutral value)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # accepted, used for nothing
    # vLLM's extensions, implemented.
    top_k: int = Field(default=0, ge=-1)  # -1 (vLLM's spelling) and 0 both disable it
    min_p: float = Field(default=0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    repetition_penalty: float = Field(default=1.0, gt=0.0, allow_inf_nan=False)
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False  # benchmarks use it to fix output lengths
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)  # keep the last N; -1: the context's worth
    priority: int = 0  # lower runs first
    # Only requests with the same salt share cached prefixes (per-tenant isolation).
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    # vLLM's extensions, accepted at their neutral value only (a 400 naming the field otherwise).
    spaces_between_special_tokens: bool = True
    use_beam_search: bool = False
    length_penalty: float = 1.0
    prompt_logprobs: int | None = None
    bad_words: list[str] | None = None
    logits_processors: list[Any] | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    request_id: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    structural_tag: str | None = None

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
        if self.logit_bias:
            raise unsupported("logit_bias", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise BadRequest("stream_options is only allowed when stream is true", param="stream_options",
                             code="invalid_value")
        neutral: list[tuple[str, bool, str]] = [
            ("spaces_between_special_tokens", self.spaces_between_special_tokens, "false (special tokens are "
             "joined as the tokenizer decodes them)"),
            ("use_beam_search", not self.use_beam_search, "beam search"),
            ("length_penalty", self.length_penalty == 1.0, "a length penalty (it applies to beam search)"),
            ("prompt_logprobs", self.prompt_logprobs is None, "prompt logprobs"),
            ("bad_words", not self.bad_words, "bad_words"),
            ("logits_processors", not self.logits_processors, "custom logits processors"),
            ("return_tokens_as_token_ids", not self.return_tokens_as_token_ids, "return_tokens_as_token_ids"),
            ("return_token_ids", not self.return_token_ids, "return_token_ids"),
            ("request_id", self.request_id is None, "a client-chosen request_id"),
            ("kv_transfer_params", self.kv_transfer_params is None, "KV transfer (disaggregated prefill)"),
            ("vllm_xargs", not self.vllm_xargs, "vllm_xargs"),
        ]
        neutral += [(name, getattr(self, name) is None, "structured output (guided decoding)")
                    for name in STRUCTURED_OUTPUT_FIELDS]
        for name, ok, what in neutral:
            if not ok:
                raise unsupported(name, what)

    def sampling_params(self, *, max_tokens: int, logprobs: int | None) -> SamplingParams:
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=max(self.top_k, 0), min_p=self.min_p, seed=self.seed, stop=tuple(stops),
                              stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
                              min_tokens=self.min_tokens, repetition_penalty=self.repetition_penalty,
                              presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                              allowed_token_ids=None if self.allowed_token_ids is None
                              else tuple(self.allowed_token_ids),
                              logprobs=logprobs, include_stop_str_in_output=self.include_stop_str_in_output,
                              skip_special_tokens=self.skip_special_tokens)

    def truncate(self, token_ids: list[int], max_model_len: int) -> list[int]:
        """vLLM's truncate_prompt_tokens: keep the prompt's last N tokens (-1: as many as leave room
        for one output token)."""
        if self.truncate_prompt_tokens is None:
            return token_ids
        keep = max_model_len - 1 if self.truncate_prompt_tokens == -1 else self.truncate_prompt_tokens
        if keep == 0:
            raise BadRequest("truncate_prompt_tokens must be -1 or >= 1", param="truncate_prompt_tokens",
                             code="invalid_value")
        return token_ids[-keep:]

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


STRUCTURED_OUTPUT_FIELDS = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                            "guided_decoding_backend", "guided_whitespace_pattern", "structural_tag")


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
    # vLLM's chat-template options: the first two implemented, the rest at their neutral value only.
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    continue_final_message: bool = False
    echo: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None

    @model_validator(mode="after")
    def _checks(self) -> ChatCompletionRequest:
        self._check_common()
        if self.continue_final_message:
            raise unsupported("continue_final_message", "continue_final_message=true")
        if self.echo:
            raise unsupported("echo", "echo=true")
        if self.chat_template is not None:
            raise unsupported("chat_template", "a request's own chat template")
        if self.chat_template_kwargs:
            raise unsupported("chat_template_kwargs", "chat_template_kwargs")
        if self.documents:
            raise unsupported("documents", "documents")
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
