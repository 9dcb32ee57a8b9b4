"""What the engine hands back: per-request results and engine-wide counters."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True, kw_only=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: dict[int, float]  # the top-n alternatives at this position, token id -> logprob


@dataclass(frozen=True, kw_only=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    # Prompt tokens served from the prefix cache when the request was first scheduled (vLLM's
    # num_cached_tokens; a re-admission after preemption recomputes its own tokens, not the prompt's).
    num_cached_tokens: int


@dataclass(frozen=True, kw_only=True)
class OutputTotals:
    """Everything a request generated, built once when it finishes."""

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None


class StepOutputError(RuntimeError):
    """A step's output was asked for totals it does not carry (a bug in the caller, not bad input)."""


@dataclass(frozen=True, kw_only=True)
class RequestOutput:
    """What one engine step added to one request: a delta, built once.

    `new_token_ids`/`new_text`/`new_logprobs` are this step's; the output with `finished` set also
    carries the totals (`token_ids`, `text`, `logprobs`), so nobody copies the output so far on every
    step. A streaming consumer forwards the deltas; one that wants the whole answer reads the final
    output (or accumulates the deltas). Reading a total on an unfinished output raises.
    """

    request_id: str
    prompt_token_ids: list[int]
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprob] | None  # None unless the request asked for logprobs
    num_output_tokens: int  # generated so far, this step's included
    finished: bool
    finish_reason: FinishReason | None
    metrics: RequestMetrics
    totals: OutputTotals | None = None  # set exactly when `finished`

    def __post_init__(self) -> None:
        assert (self.totals is not None) == self.finished, "totals come with the finished output only"

    def _totals(self) -> OutputTotals:
        if self.totals is None:
            raise StepOutputError(f"request {self.request_id}: an unfinished step's output carries only this "
                                  "step's delta (new_token_ids, new_text, new_logprobs); totals come with the "
                                  "finished output")
        return self.totals

    @property
    def token_ids(self) -> list[int]:
        return self._totals().token_ids

    @property
    def text(self) -> str:
        return self._totals().text

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        return self._totals().logprobs


@dataclass(frozen=True, kw_only=True)
class SpecDecodeStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()


@dataclass(frozen=True, kw_only=True)
class EngineStats:
    """Counters and gauges for /metrics. Counters only ever grow."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of blocks held by live sequences
    num_blocks: int
    num_free_blocks: int
    prefix_cache_queries: int  # tokens looked up
    prefix_cache_hits: int  # tokens found
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    spec_decode: SpecDecodeStats = field(default_factory=SpecDecodeStats)
