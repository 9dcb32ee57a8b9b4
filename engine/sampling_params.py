"""Per-request sampling options, validated when built."""

from __future__ import annotations

import math
from dataclasses import dataclass

from decodeservice.engine.errors import InvalidRequestError

SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # a signed 64-bit integer, as vLLM accepts
GREEDY_BELOW_TEMPERATURE = 1e-5
PENALTY_LIMIT = 2.0  # presence and frequency penalties, as OpenAI and vLLM bound them


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    # vLLM's: drop tokens whose probability is below min_p times the most likely token's; 0 disables.
    min_p: float = 0.0
    seed: int | None = None  # per-request generator: same seed, same sample, whatever the batch
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # vLLM's: EOS, stop_token_ids and stop strings cannot end the output before this many tokens.
    min_tokens: int = 0
    # HF/vLLM's: every token seen (prompt and output) has its logit divided by this when positive,
    # multiplied when negative; 1 disables.
    repetition_penalty: float = 1.0
    # OpenAI's, over the output so far: minus presence once per token seen, minus frequency per occurrence.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    allowed_token_ids: tuple[int, ...] | None = None  # vLLM's: sample only among these
    logprobs: int | None = None  # number of top alternatives to return with each sampled token
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True  # in the text; the token ids are always whole

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        if not _count(self.max_tokens) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}",
                                      param="max_tokens")
        if not _finite(self.temperature) or self.temperature < 0.0:
            raise InvalidRequestError(f"temperature must be a finite number >= 0, got {self.temperature!r}",
                                      param="temperature")
        if not _finite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}", param="top_p")
        if not _count(self.top_k) or self.top_k < 0:
            raise InvalidRequestError(f"top_k must be an integer >= 0, got {self.top_k!r}", param="top_k")
        if not _finite(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p!r}", param="min_p")
        # torch's generator takes a 64-bit seed and raises past it, which in the engine loop would kill
        # the loop for every request (found by tests/reliability/test_fuzz.py).
        if self.seed is not None and (not _count(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX):
            raise InvalidRequestError(f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}], got {self.seed!r}",
                                      param="seed")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise InvalidRequestError("logprobs must be in [0, 20]", param="logprobs")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop must be non-empty strings", param="stop")
        if not _count(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got "
                                      f"{self.min_tokens!r}", param="min_tokens")
        if not _finite(self.repetition_penalty) or self.repetition_penalty <= 0.0:
            raise InvalidRequestError(f"repetition_penalty must be a finite number > 0, got "
                                      f"{self.repetition_penalty!r}", param="repetition_penalty")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _finite(value) or not -PENALTY_LIMIT <= value <= PENALTY_LIMIT:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {value!r}", param=name)
        for name in ("stop_token_ids", "allowed_token_ids"):
            ids = getattr(self, name) or ()
            if any(not _count(t) or t < 0 for t in ids):
                raise InvalidRequestError(f"{name} must be token ids (integers >= 0)", param=name)
        if self.allowed_token_ids == ():
            raise InvalidRequestError("allowed_token_ids must not be empty", param="allowed_token_ids")

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids the model does not have are a bad request, not an index error in the engine loop."""
        for name in ("stop_token_ids", "allowed_token_ids"):
            if any(t >= vocab_size for t in getattr(self, name) or ()):
                raise InvalidRequestError(f"{name} must be below the vocabulary size {vocab_size}", param=name)

    @property
    def greedy(self) -> bool:
        # As vLLM (_SAMPLING_EPS): a temperature this small is greedy in effect, and dividing logits by
        # a subnormal one overflows to inf, whose softmax is NaN and killed the engine loop (found by
        # tests/reliability/test_fuzz.py).
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def processes_logits(self) -> bool:
        """The row is changed before sampling (`sampler.process_logits`): penalties and min_tokens
        depend on the tokens so far, so such a request takes no speculative drafts."""
        return (self.min_tokens > 0 or self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0 or self.allowed_token_ids is not None)


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
