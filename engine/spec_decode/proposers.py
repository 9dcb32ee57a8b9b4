"""Proposers draft the next tokens of decoding sequences behind one small `propose()` interface.

- `NgramProposer` (prompt lookup): find the last n tokens earlier in the prompt or the output and
  propose what followed them. No weights, nearly free, strong when the answer copies its input.
- `DraftModelProposer`: a smaller model sharing the target's vocabulary runs k autoregressive steps.
  Self-drafting is the same class over the target's first L layers (plus its final norm and head).
  The draft keeps its own paged KV cache (its own `KVCacheManager` over a pool of the target's
  geometry, without prefix caching), rolled back with the target's after every verification.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from decodeservice.engine.kv_cache import KVCacheManager
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
    # Asking costs next to nothing against a forward (a lookup, no model): the decoder checks watched
    # requests with drafts it never verifies (evidence.py's shadow drafts).
    free_to_ask: bool

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
    free_to_ask = True

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
    """The draft model's view of one sequence: a shadow Sequence whose prompt is the real tokens and
    whose outputs are the draft model's own tokens (the latest drafts), whose num_computed_tokens
    counts the K/V valid in the draft cache, and whose block_ids come from the draft's pool."""

    shadow: Sequence


class DraftModelProposer:
    free_to_ask = False  # k steps of a model

    def __init__(self, model: LlamaModel, *, num_layers: int | None, num_blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype, greedy_drafts: bool = False) -> None:
        """`greedy_drafts`: every request's drafts are the draft model's argmax, its generator left untouched
        (deterministic mode, where the verifier draws as plain decoding does)."""
        self.greedy_drafts = greedy_drafts
        self.runner = ModelRunner(model, num_blocks=num_blocks, block_size=block_size, device=device,
                                  dtype=dtype, num_layers=num_layers)
        self.max_positions = model.rotary.max_positions
        # Drafts are never shared between requests, so there is no prefix to cache.
        self.kv = KVCacheManager(num_blocks=num_blocks, block_size=block_size, enable_prefix_caching=False)
        self._states: dict[str, _DraftState] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.kv.num_free_blocks

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
                if seq.params.greedy or self.greedy_drafts:
                    token = int(rows[0].argmax())
                else:
                    q = target_probs(rows[0], seq.params)  # (V,) the draft samples as the request would
                    token = int(torch.multinomial(q, 1, generator=seq.generator))
                    probs[i].append(q)
                drafts[i].append(token)
                # The shadow's output is the draft; the last one is never fed (its K/V waits for acceptance).
                item.seq.output_token_ids.append(token)
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
        # real tokens never change, so only the shadow's drafts (its outputs) need checking.
        # The last real token is always fed again: its logits draft the first token.
        seen = shadow.token_ids
        limit = min(shadow.num_computed_tokens, len(tokens) - 1)
        valid = min(shadow.num_prompt_tokens, limit)
        while valid < limit and seen[valid] == tokens[valid]:
            valid += 1
        self.kv.truncate(shadow, valid)
        shadow.num_computed_tokens = valid
        shadow.prompt_token_ids = list(tokens)
        shadow.output_token_ids = []
        k = min(req.num_tokens, self.max_positions - len(tokens))
        # Positions up to len(tokens) + k - 2 get K/V written (the last draft is not fed).
        if k < 1 or not self.kv.allocate_slots(shadow, len(tokens) + k - 1 - valid):
            return 0
        return k

    def rollback(self, seq: Sequence, num_tokens: int) -> None:
        state = self._states.get(seq.request_id)
        if state is None:
            return
        state.shadow.num_computed_tokens = min(state.shadow.num_computed_tokens, num_tokens)
        self.kv.truncate(state.shadow, state.shadow.num_computed_tokens)

    def free(self, seq: Sequence) -> None:
        state = self._states.pop(seq.request_id, None)
        if state is not None:
            self.kv.free(state.shadow)
