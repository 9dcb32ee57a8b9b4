"""Speculation in a batch that nothing waits to join: its wall time is its longest stream's, so a draft is
worth what it saves the batch, not a share of the step."""

from __future__ import annotations

import pytest

from decodeservice.engine import SamplingParams, SpeculativeConfig
from decodeservice.engine.sequence import Sequence, SequenceStatus
from decodeservice.engine.spec_decode.decoder import SpeculativeDecoder
from decodeservice.engine.spec_decode.evidence import DraftingState
from decodeservice.engine.spec_decode.policy import BetaPrior, StepCostCurve, plan_drafts, tail_values
from decodeservice.engine.spec_decode.proposers import NgramProposer

# A CPU-like curve: at 4 streams a draft row costs what a stream's row does (1.3 ms of a 14 ms step),
# where one stream's row is cheap (0.3 ms of 10 ms).
ROWS_LIKE_STREAMS = StepCostCurve(batch_sizes=(1, 4, 16), extra_rows=((0, 64), (0, 64), (0, 64)),
                                  step_ms=((10.0, 10.0 + 64 * 0.3), (14.0, 14.0 + 64 * 1.3), (40.0, 40.0 + 64 * 2.5)))


def test_a_stream_ahead_of_the_longest_is_worth_its_row_not_its_share() -> None:
    tail = tail_values([0.9, 0.9, 0.9, 0.9], [10, 32, 32, 32], [True] * 4, curve=ROWS_LIKE_STREAMS)
    # T(4) = 14, T(3) = 10 + 4 * 2/3: its exit saves 1.33 ms a step, against a share of 3.5 ms
    assert tail.token_values[0] == pytest.approx((14.0 - (10.0 + 8 / 3)) * 4 / 14.0)
    assert tail.token_values[1:] == (1.0, 1.0, 1.0)
    # one stream: the batch is the request, every token counts in full
    assert tail_values([0.4], [7], [True], curve=ROWS_LIKE_STREAMS).token_values == (1.0,)


def test_one_longest_stream_that_cannot_draft_makes_the_others_drafts_worth_their_row() -> None:
    acceptances, remaining = [0.9, 0.1, 0.1, 0.1], [32, 32, 32, 32]
    tail = tail_values(acceptances, remaining, [True, False, False, False], curve=ROWS_LIKE_STREAMS)
    assert max(tail.token_values) < 0.5 and tail.acceptances == tuple(acceptances)
    caps = [8, 0, 0, 0]
    # as throughput the 0.9 stream drafts; as the batch's wall time it cannot shorten, nothing does
    assert plan_drafts(acceptances, caps, curve=ROWS_LIKE_STREAMS, min_gain=0.0).draft_lengths[0] > 0
    assert plan_drafts(list(tail.acceptances), caps, curve=ROWS_LIKE_STREAMS, min_gain=0.0,
                       token_values=tail.token_values).draft_lengths == (0, 0, 0, 0)


def test_longest_streams_that_all_land_drafts_still_draft_at_their_least_acceptance() -> None:
    tail = tail_values([0.95, 0.9, 0.85, 0.9], [32] * 4, [True] * 4, curve=ROWS_LIKE_STREAMS)
    assert tail.acceptances == (0.85,) * 4 and tail.token_values == (1.0,) * 4
    plan = plan_drafts(list(tail.acceptances), [8] * 4, curve=ROWS_LIKE_STREAMS, min_gain=0.0,
                       token_values=tail.token_values)
    assert all(k >= 1 for k in plan.draft_lengths)


def decoding(request_id: str, tokens: list[int]) -> Sequence:
    seq = Sequence(request_id=request_id, prompt_token_ids=tokens, params=SamplingParams(max_tokens=32, temperature=0.0))
    seq.status = SequenceStatus.RUNNING
    seq.num_computed_tokens = len(tokens) - 1
    return seq


@pytest.mark.parametrize("waiting", [0, 3])
def test_the_decoder_drafts_one_landing_stream_among_failing_ones_only_while_requests_wait(waiting: int) -> None:
    decoder = SpeculativeDecoder(SpeculativeConfig(method="ngram", num_tokens=4), NgramProposer(n_min=1, n_max=3),
                                 max_positions=2048)
    decoder.use_measured(ROWS_LIKE_STREAMS, row_cost=0.03)
    batch = [decoding(f"s{i}", [5, 6, 7, 8] * 6) for i in range(4)]
    decoder._states["s0"] = DraftingState(prior=BetaPrior(hits=19.0, misses=1.0))
    for seq in batch[1:]:
        decoder._states[seq.request_id] = DraftingState(prior=BetaPrior(hits=0.05, misses=3.0), cooldown=99)
    decoder.propose(batch, batch_size=4, waiting=waiting)
    # waiting: its early exit lets a queued request in, its tokens are throughput; none waiting: the three
    # failing streams set the batch's end, and its drafts only spend their rows
    assert (len(batch[0].spec_token_ids) > 0) == (waiting > 0)
    assert not any(seq.spec_token_ids for seq in batch[1:])


def test_the_curve_answers_are_shared_read_only() -> None:
    times = ROWS_LIKE_STREAMS.row_ms(4, 8)
    assert times is ROWS_LIKE_STREAMS.row_ms(4, 8) and not times.flags.writeable
    assert times.tolist() == pytest.approx([14.0 + 1.3 * n for n in range(9)])
