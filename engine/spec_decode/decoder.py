"""Speculative decoding inside continuous batching: who drafts, how many, verification and counters.

The decoder owns speculation: the drafts, their distributions, every request's draft length and the
rollback of rejected positions. The engine calls, every step:
1. `propose(running, batch_size=...)` before scheduling: decode-phase sequences get drafts in
   `seq.spec_token_ids`. How many is the step's plan (policy.py): each request's acceptance (a Beta
   posterior over its own checked drafts under a pessimistic prior, evidence.py) against the step time
   this batch size takes with that many more rows (measured at start-up, cost.py, and corrected by what
   drafting steps took since, step_clock.py) plus what drafting costs outside the forward (measured as
   it runs). A request starts drafting where its acceptance clears the plan's margin and stops where it
   no longer breaks even, or where its verifications gained less than they cost. A watched request is
   checked now and then with a shadow draft (n-gram: free to ask, never verified) or, for a draft model,
   a one-draft probe where a draft could pay at this batch size. Nobody drafts when the batch is at
   least `disable_batch_size`. The scheduler may then drop a sequence's drafts (no budget or no blocks
   for them): `ScheduledSequence.num_spec_tokens` says how many run;
2. the target scores the last token plus every draft in one forward;
3. `settle(item, rows, kv=...)` per speculating sequence: the accepted drafts plus one more token
   (`verify`); the rejected positions leave the target's blocks and the proposer's state, and the
   drafts are spent;
4. `free(seq)` when a sequence ends.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch

from decodeservice.engine.config import SpeculativeConfig
from decodeservice.engine.errors import ConfigError
from decodeservice.engine.kv_cache import KVCacheManager
from decodeservice.engine.model import LlamaModel
from decodeservice.engine.outputs import SpecDecodeStats
from decodeservice.engine.sampler import target_probs
from decodeservice.engine.scheduler import ScheduledSequence
from decodeservice.engine.sequence import Sequence
from decodeservice.engine.spec_decode.evidence import (
    MIN_REALIZED_EVIDENCE,
    DecoderCounters,
    DraftingState,
    Workload,
)
from decodeservice.engine.spec_decode.policy import (
    MIN_GAIN,
    StepCostCurve,
    draft_rows_ms,
    keep_and_start_acceptances,
    least_paying_acceptance,
    plan_drafts,
    request_prior,
    tail_values,
    verify_cost_units,
)
from decodeservice.engine.spec_decode.proposers import (
    DraftModelProposer,
    DraftRequest,
    NgramProposer,
    Proposer,
)
from decodeservice.engine.spec_decode.step_clock import StepClock
from decodeservice.engine.spec_decode.verify import greedy_accept, rejection_sample, sample_and_match

# (draft_ids (k,), p (k+1, V), q (k, V) or None, generator) -> accepted drafts + one token
SampledVerifier = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Generator | None], list[int]]


# A watched request whose proposer is not free to ask (a draft model) probes with one real draft only
# where a draft landing this often would pay at the batch size: where none could, learning its
# acceptance changes nothing and the probe row is a loss.
PROBE_ACCEPTANCE = 0.9
OVERHEAD_DECAY = 0.9  # weight of the past in the measured cost of drafting outside the forward


def default_self_draft_layers(num_layers: int) -> int:
    # A quarter of the target: drafting k tokens then costs about k/4 target steps.
    return max(1, num_layers // 4)


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
        self._workload = Workload()  # every request's checked drafts: new requests' prior
        self.clock = StepClock()  # what steps took, per batch size: corrects the curve's extra cost
        self.counters = DecoderCounters()
        self._step_batch = 0  # the batch size of the step in flight (propose to settle)
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
        pays), with the step costs as corrected by what steps took; starting to draft takes MIN_GAIN more."""
        if self.curve is None:
            return None
        return least_paying_acceptance(batch_size, curve=self.curve, overhead_ms=self._overhead(), min_gain=0.0,
                                       cost_scale=self._cost_scale(batch_size))

    def batch_sizes(self) -> tuple[int, ...]:
        """The batch sizes the step times were measured at, below the off switch."""
        sizes = self.curve.batch_sizes if self.curve is not None else ()
        return tuple(b for b in sizes if b < self.config.disable_batch_size)

    # -- drafting ----------------------------------------------------------------------------------
    def propose(self, running: list[Sequence], *, batch_size: int, waiting: int = 0) -> None:
        """`waiting`: requests queued for a slot (0: the batch's wall time is its longest stream's)."""
        start = time.perf_counter()
        live = {seq.request_id for seq in running}
        for request_id in [r for r in self._tracked if r not in live]:
            self.proposer.free(self._tracked.pop(request_id))  # preempted: its blocks go back now
        self._probs.clear()
        for seq in running:
            seq.spec_token_ids = []
        decoding = [seq for seq in running if not seq.in_prefill]
        self._time_step(start, running, batch_size=batch_size, all_decoding=len(decoding) == len(running))
        if not decoding:
            return
        self.counters.steps += 1
        if batch_size < self.config.disable_batch_size:
            self._draft(decoding, batch_size=max(batch_size, len(decoding)), waiting=waiting)
        self.counters.propose_ms += (time.perf_counter() - start) * 1000

    def _draft(self, decoding: list[Sequence], *, batch_size: int, waiting: int) -> None:
        # k + 1 tokens may come out: stay within max_tokens and the position table.
        caps = [max(min(self.config.num_tokens, seq.params.max_tokens - len(seq.output_token_ids) - 1,
                        self.max_positions - seq.num_tokens - 1), 0) for seq in decoding]
        lengths = self._draft_lengths(decoding, caps, batch_size, waiting=waiting)
        requests = [DraftRequest(seq=seq, num_tokens=k) for seq, k in zip(decoding, lengths, strict=True) if k >= 1]
        if not requests:
            return
        self.counters.drafting_steps += 1
        self._step_batch = batch_size
        start = time.perf_counter()
        for req, draft in zip(requests, self.proposer.propose(requests), strict=True):
            req.seq.spec_num_tokens = req.num_tokens
            self._tracked[req.seq.request_id] = req.seq
            req.seq.spec_token_ids = draft.token_ids
            if draft.probs is not None and draft.token_ids:
                self._probs[req.seq.request_id] = draft.probs
        self.propose_ms = _decayed(self.propose_ms, (time.perf_counter() - start) * 1000 / len(requests))

    def _draft_lengths(self, decoding: list[Sequence], caps: list[int], batch_size: int, *, waiting: int) -> list[int]:
        """This step's draft length per decoding sequence: the plan (policy.py) over the requests whose
        acceptance clears the bar (MIN_GAIN to start drafting, break-even to go on); the others are
        watched (evidence.py): a shadow draft after 1, 2, 4, .. MAX_COOLDOWN steps for a proposer free to
        ask, else a one-draft probe where a draft could pay at this batch size."""
        if not self.config.adaptive or self.curve is None:
            return caps
        scale, overhead = self._cost_scale(batch_size), self._overhead()
        keep_at, start_at = keep_and_start_acceptances(batch_size, curve=self.curve, overhead_ms=overhead,
                                                       cost_scale=scale, min_gain=MIN_GAIN)
        free = self.proposer.free_to_ask
        states, eligible, shadows, probes = [], [], [], set()
        for i, (seq, cap) in enumerate(zip(decoding, caps, strict=True)):
            state = self._state(seq)
            checked, hit = state.shadow_checked, state.shadow_hits
            settled = state.check_shadow(seq.token_ids)
            self.counters.shadow_checked += state.shadow_checked - checked
            self.counters.shadow_hits += state.shadow_hits - hit
            if settled is not None:
                self._workload.record(proposed=settled[0], accepted=settled[1])
                if settled[1]:
                    state.pauses = 0
                else:
                    state.back_off()
            states.append(state)
            if not cap:
                eligible.append(0)
                continue
            if state.acceptance >= (keep_at if state.drafting else start_at):
                eligible.append(cap)
                continue
            eligible.append(0)
            state.drafting = False
            if state.cooldown:
                state.cooldown -= 1
            elif start_at > 1.0:
                pass  # no acceptance pays at this batch size: nothing to learn that would change the plan
            elif free and not state.shadow:
                shadows.append(DraftRequest(seq=seq, num_tokens=cap))
            elif not free and keep_at <= PROBE_ACCEPTANCE:
                eligible[-1] = 1
                probes.add(i)
        if shadows:
            self._shadow(shadows)
        if not any(eligible):
            return eligible
        others = batch_size - len(decoding)  # in prefill, or decoding plainly: they cannot draft
        acceptances = [state.acceptance for state in states] + [0.0] * others
        values = None
        if not waiting and batch_size > 1:
            # The batch lasts as long as its longest stream; one still in its prompt is the longest.
            remaining = [seq.params.max_tokens - len(seq.output_token_ids) for seq in decoding]
            remaining += [max(remaining) + 1] * others
            tail = tail_values(acceptances, remaining, [e > 0 for e in eligible] + [False] * others, curve=self.curve)
            acceptances, values = list(tail.acceptances), tail.token_values
        plan = plan_drafts(acceptances, eligible + [0] * others, curve=self.curve,
                           overhead_ms=overhead, min_gain=0.0, cost_scale=scale, token_values=values)
        lengths = list(plan.draft_lengths[: len(decoding)])
        for i, state in enumerate(states):
            if i in probes:
                lengths[i] = 1
                self.counters.probes += 1
                state.back_off()  # the next probe waits longer unless this one lands (verify resets pauses)
            elif lengths[i] and not state.drafting:
                state.drafting, state.shadow = True, []  # its own verifications are the evidence now
                self.counters.starts += 1
        return lengths

    def _shadow(self, requests: list[DraftRequest]) -> None:
        """Shadow drafts for watched requests: asked of the proposer, never verified, checked as tokens come."""
        for req, draft in zip(requests, self.proposer.propose(requests), strict=True):
            state = self._states[req.seq.request_id]
            self.counters.shadow_drafts += 1
            if draft.token_ids:
                state.start_shadow(draft.token_ids, at=req.seq.num_tokens)
            else:
                state.back_off()  # nothing to draft from yet

    def _state(self, seq: Sequence) -> DraftingState:
        state = self._states.get(seq.request_id)
        if state is None:
            prior = request_prior(self._workload.acceptance, self._workload.evidence)
            state = self._states[seq.request_id] = DraftingState(prior=prior)
        return state

    def _cost_scale(self, batch_size: int) -> float:
        return self.clock.cost_scale(batch_size) if self.measured else 1.0

    def _time_step(self, now: float, running: list[Sequence], *, batch_size: int, all_decoding: bool) -> None:
        """Close the last step's cycle on the clock (step_clock.py) and open this one's."""
        if not self.measured or self.curve is None:
            return
        sample = self.clock.start_step(now, batch_size=batch_size, clean=all_decoding,
                                       request_ids=frozenset(seq.request_id for seq in running))
        if sample is not None:
            predicted = draft_rows_ms(sample.batch_size, sample.draft_rows, sample.drafting, curve=self.curve,
                                      overhead_ms=self.overhead_ms) if sample.draft_rows else 0.0
            self.clock.record(sample, predicted_excess_ms=predicted)

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
        self.clock.verified(len(proposed))
        spent = (time.perf_counter() - start) * 1000
        self.settle_ms = _decayed(self.settle_ms, spent)
        self.counters.settle_ms += spent
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
            self._learn(state, proposed=k, accepted=accepted)
        return tokens

    def _learn(self, state: DraftingState, *, proposed: int, accepted: int) -> None:
        """A verification's evidence; a request whose verifications gained less than they cost stops."""
        state.record(proposed=proposed, accepted=accepted)
        state.verified += proposed
        state.accepted += accepted
        if accepted:
            state.pauses = 0
        self._workload.record(proposed=proposed, accepted=accepted)
        if self.curve is None or not self.config.adaptive or not proposed:
            return
        batch = max(self._step_batch, 1)
        state.realized(tokens=accepted + 1, cost_units=verify_cost_units(
            batch, proposed, curve=self.curve, overhead_ms=self._overhead(), cost_scale=self._cost_scale(batch)))
        if state.gain_cost >= MIN_REALIZED_EVIDENCE and state.gain_tokens < state.gain_cost:
            state.stop_drafting()
            self.counters.realized_stops += 1

    def free(self, seq: Sequence) -> None:
        self._probs.pop(seq.request_id, None)
        self._tracked.pop(seq.request_id, None)
        state = self._states.pop(seq.request_id, None)
        if state is not None:
            self.counters.finished(state)
        self.proposer.free(seq)

    # -- counters ----------------------------------------------------------------------------------
    def _record(self, num_draft: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    def diagnostics(self) -> dict[str, Any]:
        """Where speculation spent its time and what it got (benchmarks), and the step clock's view."""
        return {**asdict(self.counters), "overhead_ms_per_drafting_stream": round(self.overhead_ms, 3),
                "workload_acceptance": round(self._workload.acceptance, 3), "clock": self.clock.describe()}

    def stats(self) -> SpecDecodeStats:
        return SpecDecodeStats(num_drafts=self.num_drafts, num_draft_tokens=self.num_draft_tokens,
                               num_accepted_tokens=self.num_accepted_tokens,
                               accepted_per_position=tuple(self.accepted_per_position))


def _decayed(mean: float, sample: float) -> float:
    return OVERHEAD_DECAY * mean + (1 - OVERHEAD_DECAY) * sample
