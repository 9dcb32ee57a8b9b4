"""Continuous batching with chunked prefill, priorities and preemption by recompute.

Every step the scheduler spends a token budget (`max_num_batched_tokens`) on, in order:
1. running sequences: one token each for decode (1 + k with speculative drafts), or the next chunk of
   a prompt still being prefilled, so long prompts never stall the decodes around them;
2. waiting sequences, best priority first, while the budget, `max_num_seqs` and the block pool allow.

When a running sequence cannot get a block, the lowest-priority, most recent running sequence is
preempted: its blocks are freed and it goes back to the queue, to be recomputed later (its full blocks
usually survive in the prefix cache, so recompute is cheap).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from decodeservice.engine.kv_cache import KVCacheManager
from decodeservice.engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True, kw_only=True)
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int  # tokens fed this step, from seq.num_computed_tokens on
    # Trailing draft tokens among them, to be verified: the first ones of seq.spec_token_ids. The
    # scheduler only decides how many run (all, or none when the budget or the pool is short); the
    # drafts themselves are the speculative decoder's (spec_decode/decoder.py).
    num_spec_tokens: int

    @property
    def completes_prompt(self) -> bool:
        """After this step the sequence has logits for its next token."""
        return self.seq.num_computed_tokens + self.num_new_tokens - self.num_spec_tokens >= self.seq.num_tokens


@dataclass(frozen=True, kw_only=True)
class SchedulerPlan:
    scheduled: list[ScheduledSequence]
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, *, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._arrivals = 0

    # -- queue management --------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self._arrivals += 1
        seq.arrival_order = self._arrivals
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Drop a sequence (finished or aborted) and return its blocks at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- the step plan -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerPlan:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        preempted: list[Sequence] = []

        self.running.sort(key=Sequence.sort_key)
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_spec = len(seq.spec_token_ids)
            num_new = min(seq.num_tokens + num_spec - seq.num_computed_tokens, budget)
            if num_new < seq.num_tokens + num_spec - seq.num_computed_tokens:
                num_spec = 0  # a partial step never verifies drafts
                num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.kv.allocate_slots(seq, num_new):
                if num_spec:  # drafts are optional: drop them before preempting anyone for them
                    num_new -= num_spec
                    num_spec = 0
                    continue
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                scheduled.append(ScheduledSequence(seq=seq, num_new_tokens=num_new, num_spec_tokens=num_spec))
                budget -= num_new
                index += 1
                continue
            break  # `seq` itself was preempted; everything after it already was too

        if not preempted:
            self._admit_waiting(scheduled, budget)
        return SchedulerPlan(scheduled=scheduled, preempted=preempted)

    def _admit_waiting(self, scheduled: list[ScheduledSequence], budget: int) -> None:
        self.waiting.sort(key=Sequence.sort_key)
        now = time.monotonic()
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            cached = self.kv.find_cached_prefix(seq)
            num_cached = len(cached) * self.kv.block_size
            num_new = min(seq.num_tokens - num_cached, budget)
            if not self.kv.allocate_slots(seq, num_new, cached):
                break
            self.kv.record_prefix_lookup(num_prompt_tokens=seq.num_tokens, num_hit_tokens=num_cached)
            if not cached:
                seq.num_computed_tokens = 0
                seq.num_cached_tokens = 0
            self.waiting.pop(0)
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
                seq.num_cached_prompt_tokens = num_cached
            self.running.append(seq)
            scheduled.append(ScheduledSequence(seq=seq, num_new_tokens=num_new, num_spec_tokens=0))
            budget -= num_new

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(seq)
