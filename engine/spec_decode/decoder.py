"""Speculative decoding inside continuous batching: who drafts, how many, verification and counters.

The engine calls, every step:
1. `propose(running, batch_size=...)` before scheduling: decode-phase sequences get up to k drafts in
   `seq.spec_token_ids` (k adapts per request); nobody drafts when the batch is at least
   `disable_batch_size` (verifying k extra positions then costs more than it saves);
2. the target scores the last token plus every draft in one forward;
3. `verify(seq, proposed, rows)` per speculating sequence: accepted drafts plus one more token;
4. `rollback(seq, num_computed)`: the proposer forgets rejected positions (the engine truncates the
   target's blocks itself); `free(seq)` when a sequence ends.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from decodeservice.engine.config import SpeculativeConfig
from decodeservice.engine.errors import ConfigError
from decodeservice.engine.model import LlamaModel
from decodeservice.engine.outputs import SpecDecodeStats
from decodeservice.engine.sampler import target_probs
from decodeservice.engine.sequence import Sequence
from decodeservice.engine.spec_decode.proposers import (
    DraftModelProposer,
    DraftRequest,
    NgramProposer,
    Proposer,
)
from decodeservice.engine.spec_decode.verify import greedy_accept, rejection_sample

# (draft_ids (k,), p (k+1, V), q (k, V) or None, generator) -> accepted drafts + one token
SampledVerifier = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Generator | None], list[int]]


MAX_COOLDOWN = 32
EMA_WEIGHT = 0.25  # weight of the newest verify in a request's tokens-per-verify average


def default_self_draft_layers(num_layers: int) -> int:
    # A quarter of the target: drafting k tokens then costs about k/4 target steps.
    return max(1, num_layers // 4)


class SpeculativeDecoder:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, *, max_positions: int,
                 sampled_verifier: SampledVerifier = rejection_sample) -> None:
        """`sampled_verifier` is the rule for temperature > 0; tests swap in a biased one to show the
        losslessness check can fail."""
        self.config = config
        self.proposer = proposer
        self.max_positions = max_positions
        self.sampled_verifier = sampled_verifier
        self._probs: dict[str, torch.Tensor] = {}  # request id -> q of the drafts in flight
        self._tracked: dict[str, Sequence] = {}  # sequences the proposer may hold state for
        self._misses: dict[str, int] = {}  # request id -> verifications in a row below break-even
        self._rate: dict[str, float] = {}  # request id -> average tokens per verify (accepted + 1)
        self._cooldown: dict[str, int] = {}  # request id -> steps left without drafting
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * config.num_tokens

    @classmethod
    def create(cls, config: SpeculativeConfig, *, target: LlamaModel, draft: LlamaModel | None,
               num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype) -> SpeculativeDecoder:
        max_positions = target.rotary.max_positions
        proposer: Proposer
        if config.method == "ngram":
            proposer = NgramProposer(n_min=config.ngram_min, n_max=config.ngram_max)
        elif config.method == "draft":
            if draft is None:
                raise ConfigError("speculative method 'draft' needs a draft model")
            if draft.config.vocab_size != target.config.vocab_size:
                raise ConfigError(f"the draft model's vocabulary ({draft.config.vocab_size}) differs from the "
                                  f"target's ({target.config.vocab_size})")
            proposer = DraftModelProposer(draft, num_layers=None, num_blocks=num_blocks, block_size=block_size,
                                          device=device, dtype=dtype)
            max_positions = min(max_positions, draft.rotary.max_positions)
        else:
            total = target.config.num_layers
            layers = config.draft_layers or default_self_draft_layers(total)
            if layers >= total:
                raise ConfigError(f"self_draft uses the target's first draft_layers layers; draft_layers={layers} "
                                  f"must be below the target's {total}")
            proposer = DraftModelProposer(target, num_layers=layers, num_blocks=num_blocks, block_size=block_size,
                                          device=device, dtype=dtype)
        return cls(config, proposer, max_positions=max_positions)

    # -- drafting ----------------------------------------------------------------------------------
    def propose(self, running: list[Sequence], *, batch_size: int) -> None:
        live = {seq.request_id for seq in running}
        for request_id in [r for r in self._tracked if r not in live]:
            self.proposer.free(self._tracked.pop(request_id))  # preempted: its blocks go back now
        self._probs.clear()
        requests: list[DraftRequest] = []
        enabled = batch_size < self.config.disable_batch_size
        for seq in running:
            seq.spec_token_ids = []
            if not enabled or seq.in_prefill or self._cooling(seq.request_id):
                continue
            if seq.spec_num_tokens == 0:
                seq.spec_num_tokens = self.config.num_tokens
            # k + 1 tokens may come out: stay within max_tokens and the position table.
            remaining = seq.params.max_tokens - len(seq.output_token_ids)
            k = min(seq.spec_num_tokens, remaining - 1, self.max_positions - seq.num_tokens - 1)
            if k >= 1:
                requests.append(DraftRequest(seq=seq, num_tokens=k))
                self._tracked[seq.request_id] = seq
        if not requests:
            return
        for req, draft in zip(requests, self.proposer.propose(requests), strict=True):
            req.seq.spec_token_ids = draft.token_ids
            if draft.probs is not None and draft.token_ids:
                self._probs[req.seq.request_id] = draft.probs

    # -- verification ------------------------------------------------------------------------------
    def verify(self, seq: Sequence, proposed: list[int], rows: torch.Tensor) -> list[int]:
        """Accepted drafts plus one more token (corrected or bonus). rows: (k+1, V) target logits."""
        k = len(proposed)
        draft_ids = torch.tensor(proposed, dtype=torch.long, device=rows.device)
        q = self._probs.pop(seq.request_id, None)
        if seq.params.greedy:
            tokens = greedy_accept(draft_ids, rows.argmax(dim=-1))
        else:
            p = target_probs(rows, seq.params)  # (k+1, V)
            tokens = self.sampled_verifier(draft_ids, p, None if q is None else q[:k], seq.generator)
        accepted = len(tokens) - 1
        self._record(k, accepted)
        if self.config.adaptive:
            # Grow k while every draft lands, shrink it on a miss; stay within [1, num_tokens].
            step = 1 if accepted == k else -1
            seq.spec_num_tokens = max(1, min(self.config.num_tokens, k + step))
            # A request whose drafts land too rarely pays for verification and gains nothing: when its
            # recent tokens per verify fall below the break-even, back off exponentially (2, 4, ..
            # MAX_COOLDOWN steps) and probe again after.
            rate = EMA_WEIGHT * (accepted + 1) + (1 - EMA_WEIGHT) * self._rate.get(seq.request_id, accepted + 1)
            self._rate[seq.request_id] = rate
            misses = self._misses.get(seq.request_id, 0) + 1 if rate < self.config.min_tokens_per_verify else 0
            self._misses[seq.request_id] = misses
            if misses:
                self._cooldown[seq.request_id] = min(2**misses, MAX_COOLDOWN)
        return tokens

    def _cooling(self, request_id: str) -> bool:
        left = self._cooldown.get(request_id, 0)
        if left:
            self._cooldown[request_id] = left - 1
        return left > 0

    def rollback(self, seq: Sequence, num_tokens: int) -> None:
        self.proposer.rollback(seq, num_tokens)

    def free(self, seq: Sequence) -> None:
        self._probs.pop(seq.request_id, None)
        self._tracked.pop(seq.request_id, None)
        self._misses.pop(seq.request_id, None)
        self._rate.pop(seq.request_id, None)
        self._cooldown.pop(seq.request_id, None)
        self.proposer.free(seq)

    # -- counters ----------------------------------------------------------------------------------
    def _record(self, num_draft: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    def stats(self) -> SpecDecodeStats:
        return SpecDecodeStats(num_drafts=self.num_drafts, num_draft_tokens=self.num_draft_tokens,
                               num_accepted_tokens=self.num_accepted_tokens,
                               accepted_per_position=tuple(self.accepted_per_position))
