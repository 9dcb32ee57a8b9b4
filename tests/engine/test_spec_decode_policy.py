"""The adaptive speculation rule as pure functions: synthetic step costs and acceptances in, drafts out."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from decodeservice.engine import SamplingParams, SpeculativeConfig
from decodeservice.engine.sequence import Sequence, SequenceStatus
from decodeservice.engine.spec_decode.decoder import SpeculativeDecoder
from decodeservice.engine.spec_decode.evidence import DraftingState
from decodeservice.engine.spec_decode.policy import (
    MIN_GAIN,
    BetaPrior,
    StepCostCurve,
    least_paying_acceptance,
    plan_drafts,
)
from decodeservice.engine.spec_decode.proposers import NgramProposer, ngram_lookup


def curve(plain: dict[int, float], row_ms: dict[int, float], max_rows: int = 64) -> StepCostCurve:
    """Plain step time per batch size, and what each extra row adds there (ms)."""
    sizes = tuple(sorted(plain))
    return StepCostCurve(batch_sizes=sizes, extra_rows=tuple((0, max_rows) for _ in sizes),
                         step_ms=tuple((plain[b], plain[b] + max_rows * row_ms[b]) for b in sizes))


# Memory-bound at one stream (a draft row adds 3% of the step), compute-bound at 16 (a row adds a full
# stream's share of the step, 1/16 of it): what the bundled model shows on a small CPU.
SMALL_AND_BIG = curve({1: 10.0, 4: 14.0, 16: 40.0}, {1: 0.3, 4: 1.0, 16: 2.5})


def test_a_cheap_row_is_drafted_and_a_dear_one_is_not() -> None:
    one = plan_drafts([0.7], [8], curve=SMALL_AND_BIG)
    assert one.draft_lengths[0] >= 3 and one.expected_speedup > 1.5
    assert plan_drafts([0.02], [8], curve=SMALL_AND_BIG).draft_lengths == (0,)


def test_a_compute_bound_batch_drafts_nothing_whatever_the_acceptance() -> None:
    # 16 streams, each row costs its full share: a draft can add at most one token for one row's time.
    for acceptance in (0.5, 0.9, 0.99, 1.0):
        plan = plan_drafts([acceptance] * 16, [8] * 16, curve=SMALL_AND_BIG)
        assert plan.draft_lengths == (0,) * 16 and plan.expected_speedup == 1.0
    assert least_paying_acceptance(16, curve=SMALL_AND_BIG) > 1.0
    # the same acceptance at one stream drafts
    assert plan_drafts([0.9], [8], curve=SMALL_AND_BIG).draft_lengths[0] == 8


CHEAP = curve({1: 10.0, 4: 14.0, 16: 40.0}, {1: 0.3, 4: 1.0, 16: 1.2})


@pytest.mark.parametrize("batch", [1, 4, 16])
def test_one_draft_pays_from_the_break_even_acceptance(batch: int) -> None:
    threshold = least_paying_acceptance(batch, curve=CHEAP, min_gain=0.0)
    assert 0 < threshold < 1
    others, caps = [0.0] * (batch - 1), [1] + [0] * (batch - 1)
    assert plan_drafts([threshold + 0.01, *others], caps, curve=CHEAP, min_gain=0.0).draft_lengths[0] == 1
    assert plan_drafts([threshold - 0.01, *others], caps, curve=CHEAP, min_gain=0.0).draft_lengths[0] == 0


def test_the_break_even_acceptance_rises_with_the_batch() -> None:
    # a row's cost grows relative to what a step yields: 3% of one stream's step, 1/33 of 16 streams' at 16
    thresholds = [least_paying_acceptance(b, curve=CHEAP, min_gain=0.0) for b in (1, 4, 16)]
    assert thresholds == sorted(thresholds) and thresholds[0] == pytest.approx(0.03)


def test_rows_go_to_the_streams_whose_drafts_land() -> None:
    plan = plan_drafts([0.95, 0.1, 0.8, 0.0], [8, 8, 8, 8], curve=SMALL_AND_BIG)
    k = plan.draft_lengths
    assert k[0] >= k[2] > 0 and k[1] == k[3] == 0
    # a stream that may not draft this step (paused, or at its last token) gets none, but is a row all the same
    assert plan_drafts([0.95, 0.95], [0, 8], curve=SMALL_AND_BIG).draft_lengths[0] == 0


def test_the_cost_of_drafting_outside_the_forward_counts() -> None:
    assert plan_drafts([0.5], [8], curve=SMALL_AND_BIG).draft_lengths[0] >= 1
    # proposing and verifying cost 10 ms a stream, a whole step: more than the ~1 token the drafts add
    assert plan_drafts([0.5], [8], curve=SMALL_AND_BIG, overhead_ms=10.0).draft_lengths == (0,)


def test_a_predicted_gain_below_the_margin_is_not_taken() -> None:
    # one stream, a row costs 10% of the step: one draft landing 12% of the time predicts ~+2%
    flat = curve({1: 10.0, 2: 11.0}, {1: 1.0, 2: 1.0})
    a = 0.12
    assert (1 + a) / 1.1 < 1 + MIN_GAIN
    assert plan_drafts([a], [1], curve=flat).draft_lengths == (0,)
    assert plan_drafts([a], [1], curve=flat, min_gain=0.0).draft_lengths == (1,)  # 1.12 / 1.1 > 1, barely
    assert plan_drafts([0.5], [1], curve=flat).draft_lengths == (1,)


def test_a_configured_row_cost_is_a_line_through_it() -> None:
    line = StepCostCurve.linear(0.04)
    assert line.row_ms(1, 2).tolist() == pytest.approx([1.0, 1.04, 1.08])
    assert line.row_ms(16, 1).tolist() == pytest.approx([1.6, 1.64])
    assert line.row_ms(40, 0).tolist() == pytest.approx([1 + 0.04 * 39])


def test_the_curve_interpolates_between_measured_points() -> None:
    measured = StepCostCurve(batch_sizes=(1, 4), extra_rows=((0, 1, 8), (0, 4, 32)), step_ms=((10, 11, 12), (12, 14, 30)))
    assert measured.row_ms(1, 8)[[0, 1, 4, 8]].tolist() == pytest.approx([10, 11, 11 + 3 / 7, 12])
    assert measured.row_ms(4, 40)[[0, 4, 18, 40]].tolist() == pytest.approx([12, 14, 22, 30 + 8 * 16 / 28])
    assert measured.row_ms(2, 0).tolist() == pytest.approx([10 + 2 / 3])
    with pytest.raises(ValueError, match="extra_rows"):
        StepCostCurve(batch_sizes=(1, 2), extra_rows=((1, 2), (0, 1)), step_ms=((1, 2), (1, 2)))
    with pytest.raises(ValueError, match="batch_sizes"):
        StepCostCurve(batch_sizes=(1,), extra_rows=((0, 1),), step_ms=((1, 2),))


@given(a=st.floats(0.0, 1.0), b=st.floats(0.0, 1.0), batch=st.sampled_from([1, 2, 4, 8, 16]))
def test_more_acceptance_never_drafts_less(a: float, b: float, batch: int) -> None:
    low, high = sorted((a, b))
    others = [0.3] * (batch - 1)

    def k(acceptance: float) -> int:
        return plan_drafts([acceptance, *others], [8] * batch, curve=SMALL_AND_BIG).draft_lengths[0]

    assert k(low) <= k(high)


def decoding(request_id: str, tokens: list[int]) -> Sequence:
    seq = Sequence(request_id=request_id, prompt_token_ids=tokens, params=SamplingParams(max_tokens=64, temperature=0.0))
    seq.status = SequenceStatus.RUNNING
    seq.num_computed_tokens = len(tokens) - 1
    return seq


FAILING = BetaPrior(hits=0.05, misses=3.0)  # a request whose drafts have been failing
LANDING = BetaPrior(hits=9.0, misses=1.0)


def test_a_failing_request_is_watched_with_shadow_drafts_and_drafts_once_they_land() -> None:
    decoder = SpeculativeDecoder(SpeculativeConfig(method="ngram", num_tokens=4), NgramProposer(n_min=1, n_max=3),
                                 max_positions=2048)
    decoder.use_measured(SMALL_AND_BIG, row_cost=0.03)
    seq = decoding("a", [5, 6, 7, 8] * 6)  # n-gram lookup always finds a continuation
    decoder._states["a"] = DraftingState(prior=FAILING)
    decoder.propose([seq], batch_size=1)
    state = decoder._states["a"]
    assert seq.spec_token_ids == [] and state.shadow == [5, 6, 7, 8]  # no verify row: a shadow draft
    seq.output_token_ids.append(5)  # the token that comes is the shadow draft's: a landed draft
    seq.num_computed_tokens += 1
    decoder.propose([seq], batch_size=1)
    # its own evidence outweighs the prior: a draft row costs 3% of this step, one landing in four pays
    assert state.acceptance > 0.25 and len(seq.spec_token_ids) >= 1 and state.drafting
    assert decoder.counters.shadow_hits == 1 and decoder.counters.starts == 1


def test_shadow_drafts_that_miss_back_off_and_none_are_asked_where_nothing_pays() -> None:
    decoder = SpeculativeDecoder(SpeculativeConfig(method="ngram", num_tokens=4), NgramProposer(n_min=1, n_max=3),
                                 max_positions=2048)
    decoder.use_measured(SMALL_AND_BIG, row_cost=0.03)
    seq = decoding("a", [5, 6, 7, 8] * 6)
    decoder._states["a"] = state = DraftingState(prior=FAILING)
    asked = []
    for _ in range(40):
        decoder.propose([seq], batch_size=1)
        assert seq.spec_token_ids == []
        asked.append(decoder.counters.shadow_drafts)
        guess = ngram_lookup(seq.token_ids, n_min=1, n_max=3, k=4)[:1]
        seq.output_token_ids.append(next(t for t in (5, 6, 7, 8) if [t] != guess))  # never what a draft says
        seq.num_computed_tokens += 1
    # asked at once, then each miss (seen a step later) waits 2, 4, 8, 16 steps before the next
    assert [i for i in range(1, 40) if asked[i] > asked[i - 1]] == [3, 8, 17, 34]
    assert state.acceptance < FAILING.mean and not state.drafting
    # 16 streams: no draft can pay, so nobody is asked anything, however long it waits
    batch = [decoding(f"s{i}", [5, 6, 7, 8] * 6) for i in range(16)]
    for s in batch:
        decoder._states[s.request_id] = DraftingState(prior=FAILING)
    before = decoder.counters.shadow_drafts
    for _ in range(80):
        decoder.propose(batch, batch_size=16)
        assert not any(s.spec_token_ids for s in batch)
    assert decoder.counters.shadow_drafts == before
    # ... while drafts that land still draft at one stream
    decoder._states["b"] = DraftingState(prior=LANDING)
    fresh = decoding("b", [5, 6, 7, 8] * 6)
    decoder.propose([fresh], batch_size=1)
    assert len(fresh.spec_token_ids) == 4


def test_a_disturbed_measurement_that_shows_free_rows_does_not_draft_failing_requests() -> None:
    # other work stretched the plain step as much as the verifies: every row looks free
    free = StepCostCurve(batch_sizes=(1, 4), extra_rows=((0, 8), (0, 32)), step_ms=((50.0, 49.0), (60.0, 58.0)))
    assert plan_drafts([0.05] * 4, [8] * 4, curve=free).draft_lengths == (0,) * 4
    assert sum(plan_drafts([0.9] * 4, [8] * 4, curve=free).draft_lengths) > 0  # drafts that land still pay
