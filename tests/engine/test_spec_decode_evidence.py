"""What the decoder learns and from what: the pessimistic prior, shadow drafts, the realized-gain off switch,
probes of proposers that are not free to ask, and the step clock's correction of the start-up curve."""

from __future__ import annotations

import pytest
import torch

from decodeservice.engine import SamplingParams, SpeculativeConfig
from decodeservice.engine.sequence import Sequence, SequenceStatus
from decodeservice.engine.spec_decode.decoder import SpeculativeDecoder
from decodeservice.engine.spec_decode.evidence import MIN_REALIZED_EVIDENCE, DraftingState
from decodeservice.engine.spec_decode.policy import (
    PESSIMISTIC_ACCEPTANCE,
    BetaPrior,
    StepCostCurve,
    least_paying_acceptance,
    plan_drafts,
    posterior_acceptance,
    realized_gain,
    request_prior,
    verify_cost_units,
)
from decodeservice.engine.spec_decode.proposers import Draft, DraftRequest, NgramProposer
from decodeservice.engine.spec_decode.step_clock import SCALE_BOUNDS, StepClock

# What the bundled model measured on a quiet 2-core AMD EPYC: one draft row costs 15% of a one-stream step,
# eight cost 77%; at 16 streams sixteen rows add 57%.
MEASURED = StepCostCurve(batch_sizes=(1, 4, 16), extra_rows=((0, 1, 2, 4, 8), (0, 4, 8, 16, 32), (0, 16, 32)),
                         step_ms=((9.2, 10.6, 10.9, 13.1, 16.3), (11.9, 16.2, 19.0, 26.2, 38.0), (23.7, 37.2, 47.9)))


def decoding(request_id: str, tokens: list[int], *, max_tokens: int = 64) -> Sequence:
    seq = Sequence(request_id=request_id, prompt_token_ids=tokens,
                   params=SamplingParams(max_tokens=max_tokens, temperature=0.0))
    seq.status = SequenceStatus.RUNNING
    seq.num_computed_tokens = len(tokens) - 1
    return seq


def ngram_decoder(num_tokens: int = 8) -> SpeculativeDecoder:
    decoder = SpeculativeDecoder(SpeculativeConfig(method="ngram", num_tokens=num_tokens),
                                 NgramProposer(n_min=1, n_max=4), max_positions=2048)
    decoder.use_measured(MEASURED, row_cost=0.1)
    return decoder


def test_a_new_request_with_nothing_checked_does_not_open_with_long_drafts() -> None:
    # Before: a newcomer started from the engine's acceptance (2/3 before anything was verified, capped at
    # 0.9 after) and opened with up to 8 drafts, 77% more step, before its own acceptance was known.
    decoder = ngram_decoder()
    seq = decoding("new", [5, 6, 7, 8] * 6)
    decoder.propose([seq], batch_size=1)
    assert seq.spec_token_ids == []
    assert decoder._states["new"].shadow  # it is checked for free instead
    assert request_prior(0.0, 0.0).mean == pytest.approx(PESSIMISTIC_ACCEPTANCE)
    # a pessimistic start does not pay one row at one stream on this machine's curve
    assert PESSIMISTIC_ACCEPTANCE < least_paying_acceptance(1, curve=MEASURED)


def test_the_prior_follows_the_workload_but_is_pulled_down_and_light() -> None:
    copying, chatting = request_prior(0.9, 40.0), request_prior(0.2, 40.0)
    assert 0.5 < copying.mean < 0.9 and PESSIMISTIC_ACCEPTANCE < chatting.mean < 0.2
    # thin workload evidence counts for less
    assert request_prior(0.9, 1.0).mean < copying.mean
    # a request's own checked drafts outweigh it after a few: three misses take a copying prior below 0.3
    assert posterior_acceptance(0.0, 3.0, copying) < 0.3
    assert posterior_acceptance(3.0, 0.0, BetaPrior(hits=0.2, misses=1.8)) > 0.6


def test_the_cost_of_a_verification_in_plain_step_shares() -> None:
    assert verify_cost_units(1, 0, curve=MEASURED) == pytest.approx(1.0)
    assert verify_cost_units(1, 8, curve=MEASURED) == pytest.approx(16.3 / 9.2)
    # at 4 streams a stream's share is a quarter of the step: its 4 rows' 4.3 ms cost 4 x 4.3 / 11.9 shares
    assert verify_cost_units(4, 4, curve=MEASURED) == pytest.approx(1 + 4 * (16.2 - 11.9) / 11.9)
    assert verify_cost_units(1, 1, curve=MEASURED, cost_scale=2.0) == pytest.approx(1 + 2 * 1.4 / 9.2)
    assert realized_gain(3.0, 2.0) == 1.5 and realized_gain(0.0, 0.0) == 1.0


def verify_rows(vocab: int, k: int, token: int) -> torch.Tensor:
    rows = torch.zeros(k + 1, vocab)
    rows[:, token] = 1.0  # the target always says `token`
    return rows


def test_a_request_whose_verifications_gain_less_than_they_cost_stops_drafting() -> None:
    decoder = ngram_decoder(num_tokens=2)
    seq = decoding("a", [1, 2, 3, 4])
    decoder._states["a"] = state = DraftingState(prior=BetaPrior(hits=9.0, misses=1.0), drafting=True)
    decoder._step_batch = 1
    verifications = 0
    while state.drafting:
        decoder.verify(seq, [5, 5], verify_rows(10, 2, token=0))  # every draft rejected: 1 token for 1.2 shares
        verifications += 1
        assert verifications < 10
    assert state.gain_cost == 0.0 and state.cooldown == 2 and decoder.counters.realized_stops == 1
    # four verifications' worth of evidence, not one unlucky one
    assert verifications * verify_cost_units(1, 2, curve=MEASURED) >= MIN_REALIZED_EVIDENCE
    # drafts that land keep it going
    decoder._states["b"] = landing = DraftingState(prior=BetaPrior(hits=9.0, misses=1.0), drafting=True)
    seq_b = decoding("b", [1, 2, 3, 4])
    for _ in range(20):
        decoder.verify(seq_b, [0, 0], verify_rows(10, 2, token=0))
    assert landing.drafting and landing.gain_tokens / landing.gain_cost > 2


class ModelLikeProposer:
    """A proposer that is not free to ask (as a draft model): watched requests get one-draft probes."""

    free_to_ask = False

    def __init__(self) -> None:
        self.asked = 0

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        self.asked += len(requests)
        return [Draft(token_ids=[7] * r.num_tokens) for r in requests]

    def rollback(self, seq: Sequence, num_tokens: int) -> None:
        pass

    def free(self, seq: Sequence) -> None:
        pass


def test_a_proposer_that_is_not_free_probes_rarely_and_only_where_a_draft_could_pay() -> None:
    proposer = ModelLikeProposer()
    decoder = SpeculativeDecoder(SpeculativeConfig(method="ngram", num_tokens=4), proposer, max_positions=2048)
    decoder.use_measured(MEASURED, row_cost=0.1)
    seq = decoding("a", [1, 2, 3])
    decoder._states["a"] = DraftingState(prior=BetaPrior(hits=0.05, misses=3.0))
    probes = []
    for _ in range(40):
        decoder.propose([seq], batch_size=1)
        probes.append(len(seq.spec_token_ids))
    assert set(probes) == {0, 1} and sum(probes) <= 6  # one draft at a time, waits of 2, 4, 8, 16 steps
    assert decoder.counters.shadow_drafts == 0
    # a curve on which no acceptance pays at 16 streams: nobody probes there
    dear = StepCostCurve(batch_sizes=(1, 16), extra_rows=((0, 8), (0, 32)), step_ms=((10.0, 13.0), (40.0, 120.0)))
    assert least_paying_acceptance(16, curve=dear) > 1.0
    decoder.use_measured(dear, row_cost=0.04)
    batch = [decoding(f"s{i}", [1, 2, 3]) for i in range(16)]
    for s in batch:
        decoder._states[s.request_id] = DraftingState(prior=BetaPrior(hits=0.05, misses=3.0))
    asked = proposer.asked
    for _ in range(80):
        decoder.propose(batch, batch_size=16)
    assert proposer.asked == asked


def test_the_step_clock_corrects_the_curve_from_what_drafting_steps_took() -> None:
    clock = StepClock()
    ids = frozenset({"a"})
    now = 0.0

    def step(ms: float, rows: int) -> None:
        nonlocal now
        sample = clock.start_step(now, batch_size=1, request_ids=ids, clean=True)
        if sample is not None:
            clock.record(sample, predicted_excess_ms=1.0 if sample.draft_rows else 0.0)
        clock.verified(rows)
        now += ms / 1000

    for _ in range(10):
        step(10.0, 0)
    assert clock.cost_scale(1) == 1.0  # no drafting step seen yet: the curve as measured
    for _ in range(10):
        step(13.0, 2)  # the plan predicted 1 ms more, the steps took 3 ms more
        step(10.0, 0)
    step(10.0, 0)
    assert 2.0 < clock.cost_scale(1) <= 3.0
    assert clock.cost_scale(4) == 1.0  # per batch size
    # a caller that paused for a second between steps is not a row's cost
    step(1000.0, 2)
    step(10.0, 0)
    assert clock.cost_scale(1) <= SCALE_BOUNDS[1]
    # the plan at this scale drafts less than at the curve's word
    a = [0.5]
    assert sum(plan_drafts(a, [8], curve=MEASURED, cost_scale=clock.cost_scale(1)).draft_lengths) < \
        sum(plan_drafts(a, [8], curve=MEASURED).draft_lengths)


def test_a_step_with_a_prompt_in_it_is_not_a_sample() -> None:
    clock = StepClock()
    assert clock.start_step(0.0, batch_size=1, request_ids=frozenset({"a"}), clean=True) is None
    # "b" was admitted by the last step: its prompt ran there
    assert clock.start_step(0.01, batch_size=2, request_ids=frozenset({"a", "b"}), clean=True) is None
    assert clock.start_step(0.02, batch_size=2, request_ids=frozenset({"a", "b"}), clean=False) is not None
    assert clock.start_step(0.03, batch_size=2, request_ids=frozenset({"a", "b"}), clean=True) is None  # in prefill
    sample = clock.start_step(0.04, batch_size=1, request_ids=frozenset({"a"}), clean=True)  # "b" finished
    assert sample is not None and sample.ms == pytest.approx(10.0)
