"""The demo's verdict: the median round's ratio with its spread, and the reason speculation did what it did."""

from __future__ import annotations

import pytest

from decodeservice.loadgen.metrics import RequestRecord, summarize
from decodeservice.loadgen.spec_verdict import Comparison, SpecActivity, pooled


@pytest.mark.parametrize(("ratios", "word", "sure"), [
    ((1.10, 1.25, 1.18), "faster", "every round agrees"),
    ((0.80, 0.85, 0.90), "slower", "every round agrees"),
    ((0.98, 1.04, 1.01, 0.99), "the same within 3%", "both sides of 1.0"),
    ((0.90, 1.06, 1.12), "faster", "both sides of 1.0"),
])
def test_the_verdict_reads_the_median_and_says_how_sure(ratios: tuple[float, ...], word: str, sure: str) -> None:
    verdict = Comparison(ratios=ratios).verdict
    assert f"is {word}" in verdict and sure in verdict
    assert f"median of {len(ratios)} rounds, {min(ratios):.2f}-{max(ratios):.2f}" in verdict


def test_one_slow_round_does_not_flip_the_verdict() -> None:
    # the median, not the mean: a round hit by another job's burst moves the spread, not the word
    assert "is the same" in Comparison(ratios=(1.0, 1.01, 0.99, 0.6, 1.02, 1.0)).verdict


def activity(**kw: object) -> SpecActivity:
    base: dict[str, object] = {"drafts": 10.0, "draft_tokens": 40.0, "accepted_tokens": 12.0, "output_tokens": 200,
                               "concurrency": 4, "disable_batch_size": 32, "break_even": {1: 0.05, 4: 0.3, 16: 1.2}}
    return SpecActivity(**{**base, **kw})  # type: ignore[arg-type]


def test_the_reason_names_what_held_speculation_back() -> None:
    assert "turns it off from 32" in activity(concurrency=32).reason()
    assert "compute-bound" in activity(concurrency=16).reason()
    assert "compute-bound" in activity(concurrency=20).reason()  # the measured size at or below it
    worked = activity().reason()
    assert "drafts landed 30%" in worked and "from 30% at 4 streams" in worked and "11% of the output" in worked
    assert "nothing to propose" in activity(draft_tokens=0.0, accepted_tokens=0.0, drafts=0.0).reason()
    assert "pays here" not in activity(break_even={}).reason()  # a configured cost has no measured table


def record(start: float, end: float, tokens: int) -> RequestRecord:
    return RequestRecord(start=start, end=end, chunk_times=(start + 0.1, end), output_tokens=tokens)


def test_pooled_throughput_counts_only_the_modes_own_rounds() -> None:
    first, second = [record(0.0, 2.0, 20)], [record(10.0, 12.0, 20)]  # the other mode ran from 2 to 10
    rounds = [summarize(first, label="r1"), summarize(second, label="r2")]
    summary = pooled("on", rounds, first + second, slo=None)
    assert summary.duration_s == pytest.approx(4.0) and summary.output_throughput == pytest.approx(10.0)
    assert summary.completed == 2 and summary.e2e.count == 2
