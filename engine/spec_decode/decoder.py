"""Speculative decoding inside continuous batching: who drafts, how many, verification and counters.

The decoder owns speculation: the drafts, their distributions, every request's draft length and the
rollback of rejected positions. The engine calls, every step:
1. `propose(running, batch_size=...)` before scheduling: decode-phase sequences get drafts in
   `seq.spec_token_ids`. How many is the step's plan (policy.py): each request's recent acceptance
   against the step time this batch size takes with that many more rows (measured at start-up,
   cost.py) plus what drafting costs outside the forward (measured as it runs). A request whose drafts
   do not pay pauses, then probes with one draft where one could pay at this batch size. Nobody drafts
   when the batch is at least `disable_batch_size`. The scheduler may then drop a sequence's drafts (no
   budget or no blocks for them): `ScheduledSequence.num_spec_tokens` says how many run;
2. the target scores the last token plus every draft in one forward;
3. `settle(item, rows, kv=...)` per speculating sequence: the accepted drafts plus one more token
   (`verify`); the rejected positions leave the target's blocks and the proposer's state, and the
   drafts are spent;
4. `free(seq)` when a sequence ends.
"""

from __future__ import annotations

import time
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
from decodeservice.engine.spec_decode.policy import (
    StepCostCurve,
    least_paying_acceptance,
    plan_drafts,
)
from decodeservice.engine.spec_decode.proposers import (
    DraftModelProposer,
    DraftRequest,
    NgramProposer,
    Proposer,
)
from decodeservice.engine.spec_decode.verify import greedy_accept, rejection_sample, sample_and_match

# (draft_ids (k,), p (k+1, V), q (k, V) or None, generator) -> accepted drafts + one token
SampledVerifier = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Generator | None], list[int]]


MAX_COOLDOWN = 64  # the longest pause, in steps, before a request whose drafts fail probes again
ACCEPTANCE_DECAY = 0.7  # weight of the past in a request's acceptance estimate, per verification
# A new request starts from the engine's recent acceptance over all requests (a memory of about
# 1 / (1 - decay) = 50 verifications), weighted as one rejection's worth of evidence. That estimate
# itself starts at 2/3, so before anything was verified a request drafts a few tokens and learns. On chat
# traffic, whose drafts seldom land, a short answer no longer opens with several long losing
# verifications; one landed draft is enough to lengthen k again.
WORKLOAD_DECAY = 0.98
MAX_PRIOR_ACCEPTANCE = 0.9
PRIOR_HITS, PRIOR_MISSES = 2.0, 1.0  # as one rejection's worth: acceptance 2/3
# A paused request probes only where a draft landing this often would pay at the batch size: where
# none could, learning its acceptance changes nothing and the probe row is a loss.
PROBE_ACCEPTANCE = MAX_PRIOR_ACCEPTANCE
OVERHEAD_DECAY = 0.9  # weight of the past in the measured cost of drafting outside the forward


def default_self_draft_layers(num_layers: int) -> int:
    # A quarter of the target: drafting k tokens then costs about k/4 target steps.
    return max(1, num_layers // 4)


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
        # draft_row_cost, or (unset) what the engine measured at start-up (`use_measured`); 0: every draft pays
        self.row_cost = config.draft_row_cost or 0.0
        # The step times the plan weighs rows against: None drafts num_tokens always (draft_row_cost 0, or
        # nothing measured yet); a configured draft_row_cost, a line through it.
        self.curve: StepCostCurve | None = StepCostCurve.linear(self.row_cost) if self.row_cost else None
        # What drafting costs outside the forward, ms per drafting stream, measured as it runs and decayed
        # by OVERHEAD_DECAY: proposing (the n-gram lookup, or the draft model's steps) and settling (the
        # verification and rollback).
        self.propose_ms = 0.0
        self.settle_ms = 0.0
        self.measured = False  # the curve is in ms (use_measured): the overhead counts; a configured line has no ms
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

    def use_measured(self, curve: StepCostCurve, *, row_cost: float) -> None:
        """The step times the engine measured at start-up (cost.py)."""
        self.curve, self.row_cost, self.measured = curve, row_cost, True

    def break_even_acceptance(self, batch_size: int) -> float | None:
        """The acceptance at which one draft at `batch_size` streams gains what it costs (None: every draft
        pays); the plan also asks a step's drafts for MIN_GAIN over plain decoding."""
        if self.curve is None:
            return None
        return least_paying_acceptance(batch_size, curve=self.curve, overhead_ms=self._overhead(), min_gain=0.0)

    def batch_sizes(self) -> tuple[int, ...]:
        """The batch sizes the step times were measured at, below the off switch."""
        sizes = self.curve.batch_sizes if self.curve is not None else ()
        return tuple(b for b in sizes if b < self.config.disable_batch_size)

    # -- drafting ----------------------------------------------------------------------------------
    def propose(self, running: list[Sequence], *, batch_size: int) -> None:
        live = {seq.request_id for seq in running}
        for request_id in [r for r in self._tracked if r not in live]:
            self.proposer.free(self._tracked.pop(request_id))  # preempted: its blocks go back now
        self._probs.clear()
        for seq in running:
            seq.spec_token_ids = []
        if batch_size >= self.config.disable_batch_size:
            return
        decoding = [seq for seq in running if not seq.in_prefill]
        # k + 1 tokens may come out: stay within max_tokens and the position table.
        caps = [max(min(self.config.num_tokens, seq.params.max_tokens - len(seq.output_token_ids) - 1,
                        self.max_positions - seq.num_tokens - 1), 0) for seq in decoding]
        lengths = self._draft_lengths(decoding, caps, max(batch_size, len(decoding)))
        requests: list[DraftRequest] = []
        for seq, k in zip(decoding, lengths, strict=True):
            if k >= 1:
                seq.spec_num_tokens = k
                requests.append(DraftRequest(seq=seq, num_tokens=k))
                self._tracked[seq.request_id] = seq
        if not requests:
            return
        start = time.perf_counter()
        for req, draft in zip(requests, self.proposer.propose(requests), strict=True):
            req.seq.spec_token_ids = draft.token_ids
            if draft.probs is not None and draft.token_ids:
                self._probs[req.seq.request_id] = draft.probs
        self.propose_ms = _decayed(self.propose_ms, (time.perf_counter() - start) * 1000 / len(requests))

    def _draft_lengths(self, decoding: list[Sequence], caps: list[int], batch_size: int) -> list[int]:
        """This step's draft length per decoding sequence: the plan (policy.py) over the requests not
        paused; a request the plan leaves out pauses (2, 4, .. MAX_COOLDOWN steps), then probes with one
        draft where a draft could pay at this batch size: the text may have turned to copying, or the
        batch may have shrunk."""
        if not self.config.adaptive or self.curve is None:
            return caps
        states, eligible = [], []
        for seq, cap in zip(decoding, caps, strict=True):
            state = self._states.get(seq.request_id)
            if state is None:
                state = self._states[seq.request_id] = DraftingState.starting_from(self._workload)
            if state.cooldown and cap:
                state.cooldown -= 1
                cap = 0
            states.append(state)
            eligible.append(cap)
        # Streams in prefill (and those that do not draft) are rows of the batch all the same.
        acceptances = [state.acceptance for state in states] + [0.0] * (batch_size - len(decoding))
        plan = plan_drafts(acceptances, eligible + [0] * (batch_size - len(decoding)), curve=self.curve,
                           overhead_ms=self._overhead())
        break_even = self.break_even_acceptance(batch_size)
        probes_pay = break_even is not None and break_even <= PROBE_ACCEPTANCE
        lengths = list(plan.draft_lengths[: len(decoding)])
        for i, (state, cap) in enumerate(zip(states, eligible, strict=True)):
            if not cap:
                continue
            if lengths[i]:
                state.probe_due = False
            elif state.probe_due:
                if probes_pay:
                    state.probe_due, lengths[i] = False, 1
            else:
                state.pauses += 1
                state.cooldown = min(2**state.pauses, MAX_COOLDOWN)
                state.probe_due = True
        return lengths

    @property
    def overhead_ms(self) -> float:
        return self.propose_ms + self.settle_ms

    def _overhead(self) -> float:
        return self.overhead_ms if self.measured else 0.0

    # -- verification ------------------------------------------------------------------------------
    def settle(self, item: ScheduledSequence, rows: torch.Tensor, row_argmax: list[int] | None, *,
               kv: KVCacheManager) -> list[int]:
        """After the target scored `item`'s drafts: the accepted drafts plus one more token. The
        sequence's computed tokens then end after the last accepted draft; the target's blocks past
        them (`kv`) and the proposer's state are rolled back, and the drafts are spent.

        The caller has counted the step's other tokens already (the last sampled token)."""
        start = time.perf_counter()
        seq = item.seq
        proposed = seq.spec_token_ids[: item.num_spec_tokens]
        tokens = self.verify(seq, proposed, rows, row_argmax)
        seq.num_computed_tokens += len(tokens) - 1
        kv.truncate(seq, seq.num_computed_tokens)
        self.proposer.rollback(seq, seq.num_computed_tokens)
        seq.spec_token_ids = []
        self.settle_ms = _decayed(self.settle_ms, (time.perf_counter() - start) * 1000)
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


def _decayed(mean: float, sample: float) -> float:
    return OVERHEAD_DECAY * mean + (1 - OVERHEAD_DECAY) * sample
