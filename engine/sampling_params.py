"""Per-request sampling options, validated when built."""

from __future__ import annotations

import math
from dataclasses import dataclass

from decodeservice.engine.errors import InvalidRequestError

SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # a signed 64-bit integer, as vLLM accepts
GREEDY_BELOW_TEMPERATURE = 1e-5


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    seed: int | None = None  # per-request generator: same seed, same sample, whatever the batch
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives to return with each sampled token
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}",
                                      param="max_tokens")
        if not _finite(self.temperature) or self.temperature < 0.0:
            raise InvalidRequestError(f"temperature must be a finite number >= 0, got {self.temperature!r}",
                                      param="temperature")
        if not _finite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}", param="top_p")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError(f"top_k must be an integer >= 0, got {self.top_k!r}", param="top_k")
        # torch's generator takes a 64-bit seed and raises past it, which in the engine loop would kill
        # the loop for every request (found by tests/reliability/test_fuzz.py).
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not SEED_MIN <= self.seed <= SEED_MAX):
            raise InvalidRequestError(f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}], got {self.seed!r}",
                                      param="seed")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise InvalidRequestError("logprobs must be in [0, 20]", param="logprobs")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop must be non-empty strings", param="stop")

    @property
    def greedy(self) -> bool:
        # As vLLM (_SAMPLING_EPS): a temperature this small is greedy in effect, and dividing logits by
        # a subnormal one overflows to inf, whose softmax is NaN and killed the engine loop (found by
        # tests/reliability/test_fuzz.py).
        return self.temperature < GREEDY_BELOW_TEMPERATURE


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
