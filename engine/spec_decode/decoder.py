"""Speculative decoding inside continuous batching: who drafts, how many, verification and counters.

The decoder owns speculation: the drafts, their distributions, every request's draft length and the
rollback of rejected positions. The engine calls, every step:
1. `propose(running, batch_size=...)` before scheduling: decode-phase sequences get up to k drafts in
   `seq.spec_token_ids`. k is set per request by `draft_length` from the request's recent acceptance
   and the batch size, so speculation fades out as the batch grows or the drafts stop landing; nobody
   drafts when the batch is at least `disable_batch_size`. The scheduler may then drop a sequence's
   drafts (no budget or no blocks for them): `ScheduledSequence.num_spec_tokens` says how many run;
2. the target scores the last token plus every draft in one forward;
3. `settle(item, rows, kv=...)` per speculating sequence: the accepted drafts plus one more token
   (`verify`); the rejected positions leave the target's blocks and the proposer's state, and the
   drafts are spent;
4. `free(seq)` when a sequence ends.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from decodeservice.engine.config import SpeculativeConfig
from decodeservice.engine.errors import ConfigError
from decodeservice.engine.kv_cache import KVCacheManager
from decodeservice.engine.model import LlamaModel
from decodeservice.engine.outputs import SpecDecodeStats
from decodeservice.engine.sampler import target_probs
from decodeservice.engine.scheduler import ScheduledSequence
from decodeservice.engine.sequence import Sequence
from decodeservice.engine.spec_decode.proposers import (
    DraftModelProposer,
    DraftRequest,
    NgramProposer,
    Proposer,
)
from decodeservice.engine.spec_decode.verify import greedy_accept, rejection_sample, sample_and_match

# (draft_ids (k,), p (k+1, V), q (k, V) or None, generator) -> accepted drafts + one token
SampledVerifier = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Generator | None], list[int]]


MAX_COOLDOWN = 32  # the longest pause, in steps, before a request whose drafts fail probes again
ACCEPTANCE_DECAY = 0.7  # weight of the past in a request's acceptance estimate, per verification
# A new request starts from the engine's recent acceptance over all requests (a memory of about
# 1 / (1 - decay) = 50 verifications), weighted as one rejection's worth of evidence. That estimate
# itself starts at 2/3, so before anything was verified a request drafts a few tokens and learns. On chat
# traffic, whose drafts seldom land, a short answer no longer opens with several long losing
# verifications; one landed draft is enough to lengthen k again.
WORKLOAD_DECAY = 0.98
MAX_PRIOR_ACCEPTANCE = 0.9
PRIOR_HITS, PRIOR_MISSES = 2.0, 1.0  # as one rejection's worth: acceptance 2/3


def default_self_draft_layers(num_layers: int) -> int:
    # A quarter of the target: drafting k tokens then costs about k/4 target steps.
    return max(1, num_layers // 4)


def draft_length(acceptance: float, *, batch_size: int, row_cost: float, max_tokens: int) -> int:
    """How many drafts are worth verifying (0: none).

    Draft j (1-based) is accepted with probability acceptance**j: each lands with the same chance,
    given that the ones before it did. Verifying it costs row_cost of a decode step for every sequence
    in the batch, so it pays while acceptance**j > row_cost * batch_size."""
    threshold = row_cost * batch_size
    if threshold <= 0.0 or acceptance >= 1.0:
        return max_tokens
    if acceptance <= threshold:
        return 0
    return min(max_tokens, int(math.log(threshold) / math.log(acceptance)))


@dataclass(kw_only=True)
class DraftingState:
    """What the decoder remembers about one request's drafts."""

    hits: float = PRIOR_HITS  # decayed count of accepted drafts
    misses: float = PRIOR_MISSES  # decayed count of rejections
    cooldown: int = 0  # steps left without drafting
    pauses: int = 0  # pauses in a row; the next one lasts 2**pauses steps
    probe_due: bool = False  # the pause just ended: draft one token even if the estimate says no

    @property
    def acceptance(self) -> float:
        return self.hits / (self.hits + self.misses)

    def record(self, *, proposed: int, accepted: int, decay: float = ACCEPTANCE_DECAY) -> None:
        self.hits = decay * self.hits + accepted
        self.misses = decay * self.misses + (1 if accepted < proposed else 0)
        if accepted:
            self.pauses = 0

    @classmethod
    def starting_from(cls, workload: DraftingState) -> DraftingState:
        """A new request's state: the workload's acceptance, as one rejection's worth of evidence."""
        acceptance = min(workload.acceptance, MAX_PRIOR_ACCEPTANCE)
        return cls(hits=acceptance / (1.0 - acceptance), misses=1.0)


class SpeculativeDecoder:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, *, max_positions: int,
                 sampled_verifier: SampledVerifier = rejection_sample) -> None:
        """`sampled_verifier` is the rule for temperature > 0; tests swap in a biased one to show the
        losslessness check can fail."""
        self.config = config
        # draft_row_cost, or (unset) what the engine measured at start-up; 0 until then: every draft pays
        self.row_cost = config.draft_row_cost or 0.0
        self.proposer = proposer
        self.max_positions = max_positions
        self.sampled_verifier = sampled_verifier
        self._probs: dict[str, torch.Tensor] = {}  # request id -> q of the drafts in flight
        self._tracked: dict[str, Sequence] = {}  # sequences the proposer may hold state for
        self._states: dict[str, DraftingState] = {}
        self._workload = DraftingState()  # every request's verifications, decayed by WORKLOAD_DECAY
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * config.num_tokens

    @classmethod
    def create(cls, config: SpeculativeConfig, *, target: LlamaModel, draft: LlamaModel | None,
               num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype,
               deterministic: bool = False) -> SpeculativeDecoder:
        """`deterministic` (EngineConfig.deterministic): sampled requests verify by sample_and_match, and a
        draft model drafts its argmax, so the request's generator draws what plain decoding draws."""
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
                                          device=device, dtype=dtype, greedy_drafts=deterministic)
            max_positions = min(max_positions, draft.rotary.max_positions)
        else:
            total = target.config.num_layers
            layers = config.draft_layers or default_self_draft_layers(total)
            if layers >= total:
                raise ConfigError(f"self_draft uses the target's first draft_layers layers; draft_layers={layers} "
                                  f"must be below the target's {total}")
            proposer = DraftModelProposer(target, num_layers=layers, num_blocks=num_blocks, block_size=block_size,
                                          device=device, dtype=dtype, greedy_drafts=deterministic)
        return cls(config, proposer, max_positions=max_positions,
                   sampled_verifier=sample_and_match if deterministic else rejection_sample)

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
            if not enabled or seq.in_prefill:
                continue
            k = self._draft_length(seq, batch_size)
            # k + 1 tokens may come out: stay within max_tokens and the position table.
            remaining = seq.params.max_tokens - len(seq.output_token_ids)
            k = min(k, remaining - 1, self.max_positions - seq.num_tokens - 1)
            if k >= 1:
                requests.append(DraftRequest(seq=seq, num_tokens=k))
                self._tracked[seq.request_id] = seq
        if not requests:
            return
        for req, draft in zip(requests, self.proposer.propose(requests), strict=True):
            req.seq.spec_token_ids = draft.token_ids
            if draft.probs is not None and draft.token_ids:
                self._probs[req.seq.request_id] = draft.probs

    def _draft_length(self, seq: Sequence, batch_size: int) -> int:
        if not self.config.adaptive:
            seq.spec_num_tokens = self.config.num_tokens
            return seq.spec_num_tokens
        state = self._states.get(seq.request_id)
        if state is None:
            state = self._states[seq.request_id] = DraftingState.starting_from(self._workload)
        if state.cooldown:
            state.cooldown -= 1
            return 0
        k = draft_length(state.acceptance, batch_size=batch_size, row_cost=self.row_cost,
                         max_tokens=self.config.num_tokens)
        if k == 0 and not state.probe_due:
            # Not worth drafting now. Pause (2, 4, .. MAX_COOLDOWN steps), then probe with one draft:
            # the text may have turned to copying, or the batch may have shrunk.
            state.pauses += 1
            state.cooldown = min(2**state.pauses, MAX_COOLDOWN)
            state.probe_due = True
            return 0
        state.probe_due = False
        seq.spec_num_tokens = max(k, 1)
        return seq.spec_num_tokens

    # -- verification ------------------------------------------------------------------------------
    def settle(self, item: ScheduledSequence, rows: torch.Tensor, row_argmax: list[int] | None, *,
               kv: KVCacheManager) -> list[int]:
        """After the target scored `item`'s drafts: the accepted drafts plus one more token. The
        sequence's computed tokens then end after the last accepted draft; the target's blocks past
        them (`kv`) and the proposer's state are rolled back, and the drafts are spent.

        The caller has counted the step's other tokens already (the last sampled token)."""
        seq = item.seq
        proposed = seq.spec_token_ids[: item.num_spec_tokens]
        tokens = self.verify(seq, proposed, rows, row_argmax)
        seq.num_computed_tokens += len(tokens) - 1
        kv.truncate(seq, seq.num_computed_tokens)
        self.proposer.rollback(seq, seq.num_computed_tokens)
        seq.spec_token_ids = []
        return tokens

    def verify(self, seq: Sequence, proposed: list[int], rows: torch.Tensor, row_argmax: list[int] | None = None
               ) -> list[int]:
        """Accepted drafts plus one more token (corrected or bonus). rows: (k+1, V) target logits;
        row_argmax: their argmax where the runner found it already (greedy requests)."""
        k = len(proposed)
        draft_ids = torch.tensor(proposed, dtype=torch.long, device=rows.device)
        q = self._probs.pop(seq.request_id, None)
        if seq.params.greedy:
            targets = rows.argmax(dim=-1) if row_argmax is None else torch.tensor(row_argmax, device=rows.device)
            tokens = greedy_accept(draft_ids, targets)
        else:
            p = target_probs(rows, seq.params)  # (k+1, V)
            tokens = self.sampled_verifier(draft_ids, p, None if q is None else q[:k], seq.generator)
        accepted = len(tokens) - 1
        self._record(k, accepted)
        state = self._states.get(seq.request_id)
        if state is not None:
            state.record(proposed=k, accepted=accepted)
            self._workload.record(proposed=k, accepted=accepted, decay=WORKLOAD_DECAY)
        return tokens

    def free(self, seq: Sequence) -> None:
        self._probs.pop(seq.request_id, None)
        self._tracked.pop(seq.request_id, None)
        self._states.pop(seq.request_id, None)
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
