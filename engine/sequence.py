"""A request as the scheduler sees it: tokens, progress through them, and its blocks."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from decodeservice.engine.outputs import FinishReason, TokenLogprob
from decodeservice.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False, kw_only=True)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0  # lower runs first; ties are first come, first served
    arrival_time: float = field(default_factory=time.monotonic)
    arrival_order: int = 0
    # Enters the root of the prefix-cache hash chain: only requests with the same salt share blocks.
    cache_salt: str | None = None

    status: SequenceStatus = SequenceStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens whose K/V are in the cache. The last sampled token is never among them: it is the input
    # of the next step.
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    generator: torch.Generator | None = None

    # Speculative decoding, written by the speculative decoder only: the drafts proposed for the next
    # step (the scheduler runs the first ScheduledSequence.num_spec_tokens of them) and the adaptive
    # draft length.
    spec_token_ids: list[int] = field(default_factory=list)
    spec_num_tokens: int = 0

    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0  # served from the prefix cache at the last admission (the KV manager's)
    num_cached_prompt_tokens: int = 0  # ... at the first: what usage and metrics report
    num_preemptions: int = 0

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def in_prefill(self) -> bool:
        return self.num_computed_tokens < self.num_tokens - 1

    def sort_key(self) -> tuple[int, int]:
        return (self.priority, self.arrival_order)
