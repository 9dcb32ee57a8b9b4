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
    num_cached_tokens: int  # prompt tokens served from the prefix cache (last admission)


@dataclass(frozen=True, kw_only=True)
class RequestOutput:
    """A snapshot of one request after an engine step.

    `token_ids`/`text` are cumulative; `new_token_ids`/`new_text` are what this step added, so a
    streaming server can forward deltas without diffing.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: FinishReason | None
    logprobs: list[TokenLogprob] | None
    metrics: RequestMetrics


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
