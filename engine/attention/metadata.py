"""What attention needs to know about one step: where each sequence's keys lie in the paged pool.

The runner builds this once per step; every layer reads it. Pool slots are flat indices into a cache
viewed as (num_blocks * block_size, Hkv, D): slot = block_id * block_size + offset.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class SlotRun:
    """Consecutive pool slots holding consecutive keys of one sequence: a plain view of the pool."""

    first_slot: int
    length: int


@dataclass(frozen=True, kw_only=True)
class SequenceSpan:
    """One sequence in the step: Q new tokens (packed at token_start) attending over L keys.

    The new tokens sit at positions L - Q .. L - 1, so query i sees keys 0 .. L - Q + i: the cached
    prefix in full and the new tokens causally. This covers decode (Q = 1), a prompt chunk over a
    cached prefix and a speculative verify (Q = 1 + drafts, unequal across sequences)."""

    token_start: int
    num_new: int  # Q
    context_len: int  # L = cached + new
    runs: tuple[SlotRun, ...]  # cover keys 0 .. L - 1 in order (the new ones are written first)
    block_table: torch.Tensor  # (ceil(L / block_size),) block ids on the device, for gathering backends
    # Prompt rows (a chunk, a prefix hit's tail, a preempted sequence's recompute): where its tokens were
    # split into chunks and how much of them the prefix cache held must not change what any row computes,
    # so the CPU backend gives each such row the same function (native_decode.py's row per token).
    prompt: bool = False

    @property
    def num_cached(self) -> int:
        return self.context_len - self.num_new


@dataclass(frozen=True, kw_only=True)
class AttentionMetadata:
    """What every backend reads. A backend's `plan()` returns its own subclass with what it derives
    once per step for every layer (paged_views.PagedViewsMetadata, flex.FlexMetadata)."""

    slot_mapping: torch.Tensor  # (N,) pool slot each new token's K/V is written to
    spans: tuple[SequenceSpan, ...]  # in packed order, covering tokens 0 .. N - 1
    block_size: int


def slot_of(block_ids: Seq[int], position: int, block_size: int) -> int:
    """The pool slot that holds the K/V of `position` in a sequence with this block table."""
    return block_ids[position // block_size] * block_size + position % block_size


def slot_runs(block_ids: Seq[int], *, num_tokens: int, block_size: int) -> tuple[SlotRun, ...]:
    """Split the first `num_tokens` keys of a block table into runs of consecutive pool slots.

    Blocks b, b + 1, ... hold consecutive slots, so a table like [7, 8, 9, 3, 4] is two runs. The
    allocator prefers the block after a sequence's last one, so one run is the common case."""
    runs: list[SlotRun] = []
    start = 0
    first = block_ids[0] if num_tokens else 0
    needed = -(-num_tokens // block_size)
    for i in range(1, needed + 1):
        if i == needed or block_ids[i] != block_ids[i - 1] + 1:
            end = min(i * block_size, num_tokens)
            runs.append(SlotRun(first_slot=first * block_size, length=end - start))
            if i < needed:
                start, first = i * block_size, block_ids[i]
    return tuple(runs)


def trim_runs(runs: Seq[SlotRun], num_tokens: int) -> list[SlotRun]:
    """The runs covering only the first `num_tokens` keys."""
    kept: list[SlotRun] = []
    left = num_tokens
    for run in runs:
        if left <= 0:
            break
        kept.append(run if run.length <= left else SlotRun(first_slot=run.first_slot, length=left))
        left -= run.length
    return kept
