"""Proposers draft the next tokens of decoding sequences behind one small `propose()` interface.

- `NgramProposer` (prompt lookup): find the last n tokens earlier in the prompt or the output and
  propose what followed them. No weights, nearly free, strong when the answer copies its input.
- `DraftModelProposer`: a smaller model sharing the target's vocabulary runs k autoregressive steps.
  Self-drafting is the same class over the target's first L layers (plus its final norm and head).
  The draft keeps its own paged KV cache (own block pool of the target's geometry), rolled back
  with the target's after every verification.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from decodeservice.engine.model import LlamaModel
from decodeservice.engine.runner import ModelRunner
from decodeservice.engine.sampler import target_probs
from decodeservice.engine.scheduler import ScheduledSequence, SchedulerPlan
from decodeservice.engine.sequence import Sequence


@dataclass(frozen=True, kw_only=True)
class DraftRequest:
    seq: Sequence
    num_tokens: int  # the most drafts wanted (>= 1)


@dataclass(frozen=True, kw_only=True)
class Draft:
    token_ids: list[int]  # may be shorter than asked, or empty
    # (len, V) the distribution each draft was sampled from; None: deterministic drafts (one-hot q).
    probs: torch.Tensor | None = None


class Proposer(Protocol):
    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        """One Draft per request, in order."""

    def rollback(self, seq: Sequence, num_tokens: int) -> None:
        """Only the first `num_tokens` tokens of `seq` are now valid (the rest were rejected)."""

    def free(self, seq: Sequence) -> None:
        """Drop any state kept for `seq` (finished, aborted or preempted)."""


def ngram_lookup(tokens: list[int], *, n_min: int, n_max: int, k: int) -> list[int]:
    """Up to k tokens that followed an earlier occurrence of the last n tokens, trying the longest n
    first (a longer match is a more specific context, so a better guess)."""
    length = len(tokens)
    if length < 2 or k < 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        # Windows that end before the last token, so a match always has a follower.
        windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)  # (length - n, n)
        hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
        if hits.size:
            # The latest match with k followers (nearest context); in a periodic tail the latest
            # match overlaps the suffix and has too few followers, so fall back to the earliest.
            full = hits[hits + n + k <= length]
            start = int(full[-1] if full.size else hits[0]) + n
            return [int(t) for t in arr[start : start + k]]
    return []


class NgramProposer:
    def __init__(self, *, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        return [Draft(token_ids=ngram_lookup(r.seq.token_ids, n_min=self.n_min, n_max=self.n_max,
                                             k=r.num_tokens)) for r in requests]

    def rollback(self, seq: Sequence, num_tokens: int) -> None:
        pass  # stateless: it reads the sequence's tokens every time

    def free(self, seq: Sequence) -> None:
        pass


@dataclass(eq=False, kw_only=True)
class _DraftState:
    """The draft model's view of one sequence: a shadow Sequence whose tokens are the real tokens
    plus the latest drafts, whose num_computed_tokens counts the K/V valid in the draft cache, and
    whose block_ids come from the draft's own pool."""

    shadow: Sequence
    num_real: int = 0  # tokens of the shadow that were real (not drafts) when last proposed


class DraftModelProposer:
    def __init__(self, model: LlamaModel, *, num_layers: int | None, num_blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.runner = ModelRunner(model, num_blocks=num_blocks, block_size=block_size, device=device,
                                  dtype=dtype, num_layers=num_layers)
        self.block_size = block_size
        self.max_positions = model.rotary.max_positions
        self._free_blocks: deque[int] = deque(range(num_blocks))
        self._states: dict[str, _DraftState] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_blocks)

    def owned_blocks(self) -> dict[str, list[int]]:
        """Block ids held per request id (for consistency checks)."""
        return {rid: list(st.shadow.block_ids) for rid, st in self._states.items()}

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        drafts: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        wanted: list[int] = []
        active: list[int] = []
        for i, req in enumerate(requests):
            k = self._prepare(req)
            wanted.append(k)
            if k:
                active.append(i)
        # Round 0 catches each draft cache up on every real token it has not seen (the whole prompt
        # the first time) and drafts token 1; each later round feeds the previous draft.
        while active:
            items = []
            for i in active:
                shadow = self._states[requests[i].seq.request_id].shadow
                items.append(ScheduledSequence(seq=shadow, num_new_tokens=shadow.num_tokens - shadow.num_computed_tokens,
                                               num_spec_tokens=0))
            logits = self.runner.execute(SchedulerPlan(scheduled=items))
            still: list[int] = []
            for i, item, rows in zip(active, items, logits.rows, strict=True):
                assert rows is not None
                seq = requests[i].seq
                item.seq.num_computed_tokens += item.num_new_tokens
                if seq.params.greedy:
                    token = int(rows[0].argmax())
                else:
                    q = target_probs(rows[0], seq.params)  # (V,) the draft samples as the request would
                    token = int(torch.multinomial(q, 1, generator=seq.generator))
                    probs[i].append(q)
                drafts[i].append(token)
                # The shadow carries the draft; the last one is never fed (its K/V waits for acceptance).
                item.seq.prompt_token_ids.append(token)
                if len(drafts[i]) < wanted[i]:
                    still.append(i)
            active = still
        return [Draft(token_ids=d, probs=torch.stack(p) if p else None) for d, p in zip(drafts, probs, strict=True)]

    def _prepare(self, req: DraftRequest) -> int:
        """Sync the draft state with the sequence's real tokens and reserve blocks for this round.
        Returns how many drafts to make (0: the draft pool is full, skip this sequence)."""
        seq = req.seq
        tokens = seq.token_ids
        state = self._states.get(seq.request_id)
        if state is None:
            state = _DraftState(shadow=Sequence(request_id=seq.request_id, prompt_token_ids=[], params=seq.params))
            self._states[seq.request_id] = state
        shadow = state.shadow
        # Keep the computed draft K/V only as far as the shadow's tokens agree with the real ones:
        # real tokens never change, so only the drafts past num_real need checking.
        # The last real token is always fed again: its logits draft the first token.
        limit = min(shadow.num_computed_tokens, len(tokens) - 1)
        valid = min(state.num_real, limit)
        while valid < limit and shadow.prompt_token_ids[valid] == tokens[valid]:
            valid += 1
        shadow.num_computed_tokens = valid
        k = min(req.num_tokens, self.max_positions - len(tokens))
        self._truncate(state, shadow.num_computed_tokens)
        # Positions up to len(tokens) + k - 2 get K/V written (the last draft is not fed).
        needed = -(-(len(tokens) + k - 1) // self.block_size) - len(shadow.block_ids)
        if k < 1 or needed > len(self._free_blocks):
            shadow.prompt_token_ids = list(tokens)
            state.num_real = len(tokens)
            return 0
        for _ in range(max(needed, 0)):
            shadow.block_ids.append(self._free_blocks.popleft())
        shadow.prompt_token_ids = list(tokens)
        state.num_real = len(tokens)
        return k

    def _truncate(self, state: _DraftState, num_tokens: int) -> None:
        keep = -(-num_tokens // self.block_size)
        spare = state.shadow.block_ids[keep:]
        del state.shadow.block_ids[keep:]
        self._free_blocks.extend(spare)

    def rollback(self, seq: Sequence, num_tokens: int) -> None:
        state = self._states.get(seq.request_id)
        if state is None:
            return
        state.shadow.num_computed_tokens = min(state.shadow.num_computed_tokens, num_tokens)
        self._truncate(state, state.shadow.num_computed_tokens)

    def free(self, seq: Sequence) -> None:
        state = self._states.pop(seq.request_id, None)
        if state is not None:
            self._free_blocks.extend(state.shadow.block_ids)
            state.shadow.block_ids = []
