"""Windowed percentiles and attainment from cumulative-histogram deltas (pure, hand-computed values)."""

from __future__ import annotations

import math

import pytest

from decodeservice.operator.autoscaler.types import ClassMetrics, Histogram, PodSample
from decodeservice.operator.autoscaler.window import (
    FleetHistory,
    WindowedHistogram,
    offered_rate,
    valid_sample,
)

INF = math.inf
BOUNDS = (0.1, 0.5, 1.0, INF)


def hist(*counts: float, bounds: tuple[float, ...] = BOUNDS) -> Histogram:
    return Histogram(bounds=bounds, counts=tuple(counts), total=counts[-1])


def sample(pod: str, at: float, ttft: Histogram | None, *, cls: str = "interactive", inflight: float = 0.0,
           kv: float | None = 0.1) -> PodSample:
    return PodSample(pod=pod, at=at, classes={cls: ClassMetrics(ttft=ttft, itl=None, queue_depth=0.0)},
                     inflight=inflight, kv_cache_usage=kv, engine_waiting=0.0, engine_running=inflight)


def test_quantile_interpolates_inside_the_bucket_like_histogram_quantile() -> None:
    w = WindowedHistogram(bounds=BOUNDS, counts=(10, 30, 40, 40))
    # rank 20 of 40 falls in (0.1, 0.5] holding 20, 10 below: 0.1 + 0.4 * 10/20
    assert w.quantile(0.5) == pytest.approx(0.3)
    # rank 38: (0.5, 1.0] holds 10, 30 below: 0.5 + 0.5 * 8/10
    assert w.quantile(0.95) == pytest.approx(0.9)
    # the first bucket interpolates from 0
    assert w.quantile(0.1) == pytest.approx(0.04)


def test_a_rank_in_the_inf_bucket_gives_the_highest_finite_bound() -> None:
    w = WindowedHistogram(bounds=BOUNDS, counts=(10, 30, 40, 50))
    assert w.quantile(0.95) == 1.0
    assert WindowedHistogram(bounds=BOUNDS, counts=(0, 0, 0, 0)).quantile(0.95) is None


def test_attainment_is_the_interpolated_share_at_or_under_the_threshold() -> None:
    w = WindowedHistogram(bounds=BOUNDS, counts=(10, 30, 40, 40))
    assert w.share_at_most(0.3) == pytest.approx((10 + 20 * 0.5) / 40)
    assert w.share_at_most(0.05) == pytest.approx(5 / 40)
    assert w.share_at_most(1.0) == 1.0
    over = WindowedHistogram(bounds=BOUNDS, counts=(10, 30, 40, 50))
    assert over.share_at_most(2.0) == pytest.approx(40 / 50)  # the +Inf bucket is above any threshold
    assert WindowedHistogram(bounds=BOUNDS, counts=(0, 0, 0, 0)).share_at_most(1.0) is None


def test_window_sums_deltas_over_pods_and_ignores_what_came_before() -> None:
    h = FleetHistory(horizon_seconds=60)
    # pod a: 100 old observations under 0.1, then 4 in (0.1, 0.5] and 2 in (0.5, 1.0] inside the window
    for at, c in ((0, (100, 100, 100, 100)), (5, (100, 104, 104, 104)), (10, (100, 104, 106, 106))):
        assert h.add(sample("a", at, hist(*c)))
    # pod b: 2 under 0.1 in the window
    for at, c in ((0, (7, 7, 7, 7)), (10, (9, 9, 9, 9))):
        assert h.add(sample("b", at, hist(*c)))
    w = h.histogram("interactive", "ttft", start=0, now=10)
    assert w is not None and w.counts == (2, 6, 8, 8)
    # a window that starts at 5 sees pod a's second delta only; pod b's baseline is its sample at 0
    w5 = h.histogram("interactive", "ttft", start=5, now=10)
    assert w5 is not None and w5.counts == (2, 2, 4, 4)


def test_counter_reset_counts_the_restarted_pods_values_as_new() -> None:
    h = FleetHistory(horizon_seconds=60)
    h.add(sample("a", 0, hist(50, 60, 70, 70)))
    h.add(sample("a", 5, hist(52, 62, 72, 72)))  # +2 under 0.1
    h.add(sample("a", 10, hist(1, 3, 3, 3)))  # restarted: counts went down, these 3 are new
    w = h.histogram("interactive", "ttft", start=0, now=10)
    assert w is not None and w.counts == (2 + 1, 2 + 3, 2 + 3, 2 + 3)


def test_pods_age_out_and_old_samples_are_dropped() -> None:
    h = FleetHistory(horizon_seconds=30)
    h.add(sample("gone", 0, hist(1, 1, 1, 1)))
    for at in range(0, 100, 5):
        h.add(sample("a", at, hist(at, at, at, at)))
        h.prune(at)
    assert h.pods == ("a",)
    # the window ending now covers 30 s: one baseline sample at 65 plus 6 newer ones
    w = h.histogram("interactive", "ttft", start=95 - 30, now=95)
    assert w is not None and w.total == 30
    assert h.histogram("interactive", "ttft", start=0, now=95) == w  # older samples are gone


@pytest.mark.parametrize("bad", [
    hist(1, 2, math.nan, 3),
    hist(1, 3, 2, 3),  # decreasing buckets
    hist(1, 2, 3, -1),
    Histogram(bounds=(0.1, 0.5, 1.0, 2.0), counts=(1, 2, 3, 4), total=4),  # no +Inf bucket
    Histogram(bounds=(0.5, 0.1, 1.0, INF), counts=(1, 2, 3, 4), total=4),
    Histogram(bounds=BOUNDS, counts=(1, 2, 3), total=3),
    hist(1, 2, 3, 1e300),
    Histogram(bounds=BOUNDS, counts=(1, 2, 3, 4), total=math.inf),
])
def test_garbage_histograms_are_rejected_whole(bad: Histogram) -> None:
    h = FleetHistory(horizon_seconds=60)
    assert not h.add(sample("a", 0, bad))
    assert h.pods == ()


@pytest.mark.parametrize(("inflight", "kv"), [(math.nan, 0.1), (-1.0, 0.1), (1e12, 0.1), (1.0, 1.5), (1.0, -0.1)])
def test_garbage_gauges_are_rejected(inflight: float, kv: float) -> None:
    assert not valid_sample(sample("a", 0, None, inflight=inflight, kv=kv))


def test_repeated_or_older_samples_are_not_kept() -> None:
    h = FleetHistory(horizon_seconds=60)
    assert h.add(sample("a", 5, hist(1, 1, 1, 1)))
    assert not h.add(sample("a", 5, hist(2, 2, 2, 2)))
    assert not h.add(sample("a", 4, hist(2, 2, 2, 2)))
    assert h.has("a", 5)


def test_an_implausible_burst_of_observations_is_dropped() -> None:
    h = FleetHistory(horizon_seconds=60, max_observations_per_second=1000)
    h.add(sample("a", 0, hist(0, 0, 0, 0)))
    h.add(sample("a", 5, hist(0, 0, 0, 1e6)))  # 200k/s: no proxy observes that many
    w = h.histogram("interactive", "ttft", start=0, now=5)
    assert w is None


def test_a_class_that_appears_between_scrapes_starts_from_zero() -> None:
    h = FleetHistory(horizon_seconds=60)
    h.add(sample("a", 0, hist(5, 5, 5, 5), cls="batch"))
    h.add(PodSample(pod="a", at=5, inflight=0.0, kv_cache_usage=None, engine_waiting=None, engine_running=None,
                    classes={"batch": ClassMetrics(ttft=hist(5, 5, 5, 5), itl=None, queue_depth=0.0),
                             "interactive": ClassMetrics(ttft=hist(0, 3, 3, 3), itl=None, queue_depth=0.0)}))
    w = h.histogram("interactive", "ttft", start=0, now=5)
    assert w is not None and w.counts == (0, 3, 3, 3)
    assert h.classes() == ("batch", "interactive")


def test_pods_with_other_buckets_are_left_out_by_the_majority_layout() -> None:
    h = FleetHistory(horizon_seconds=60)
    other = (0.2, 2.0, INF)
    for pod, n in (("a", 10), ("b", 10)):
        h.add(sample(pod, 0, hist(0, 0, 0, 0)))
        h.add(sample(pod, 5, hist(n, n, n, n)))
    h.add(sample("c", 0, hist(0, 0, 0, bounds=other)))
    h.add(sample("c", 5, hist(3, 3, 3, bounds=other)))
    w = h.histogram("interactive", "ttft", start=0, now=5)
    assert w is not None and w.bounds == BOUNDS and w.total == 20


def queued(pod: str, at: float, served: float, waiting: float) -> PodSample:
    return PodSample(pod=pod, at=at, classes={"interactive": ClassMetrics(
        ttft=hist(served, served, served, served), itl=None, queue_depth=waiting)},
        inflight=0.0, kv_cache_usage=0.1, engine_waiting=0.0, engine_running=0.0)


def test_offered_rate_is_first_tokens_plus_queue_growth_over_the_fleets_span() -> None:
    h = FleetHistory(horizon_seconds=60)
    for s in (queued("a", 0, 0, 0), queued("a", 10, 20, 0), queued("a", 20, 40, 10),  # 40 served + 10 queued
              queued("b", 10, 0, 0), queued("b", 20, 10, 0)):  # joined at 10: 10 served since
        assert h.add(s)
    rate, span = offered_rate(h, {"a", "b"}, start=-1, now=20)
    assert span == 20 and rate == pytest.approx((50 + 10) / 20)  # not 50/20 + 10/10: b took its share late
    assert offered_rate(h, {"a"}, start=10, now=20) == (pytest.approx(3.0), 10)  # 20 served + 10 queued
    assert offered_rate(h, set(), start=-1, now=20) == (0.0, 0.0)


def test_offered_rate_survives_a_restart_and_a_draining_queue() -> None:
    h = FleetHistory(horizon_seconds=60)
    for s in (queued("a", 0, 100, 30), queued("a", 10, 5, 0)):  # restarted: 5 served since, the queue gone
        assert h.add(s)
    rate, _ = offered_rate(h, {"a"}, start=-1, now=10)
    assert rate == 0.0  # 5 served - 30 fewer waiting: clamped, never negative
    h.add(queued("a", 20, 45, 0))  # the queue drained: 40 first tokens, none waiting: 40 arrived
    assert offered_rate(h, {"a"}, start=10, now=20)[0] == pytest.approx(4.0)


def test_requests_shed_for_capacity_count_as_offered() -> None:
    # A fleet that sheds at its queue limits must not read its shedding as falling demand.
    def shedding(at: float, served: float, shed: float) -> PodSample:
        return PodSample(pod="a", at=at, classes={"interactive": ClassMetrics(
            ttft=hist(served, served, served, served), itl=None, queue_depth=64.0, shed=shed)},
            inflight=32.0, kv_cache_usage=0.5, engine_waiting=0.0, engine_running=32.0)

    h = FleetHistory(horizon_seconds=60)
    for s in (shedding(0, 0, 0), shedding(10, 20, 30), shedding(20, 40, 3)):  # restarted before 20: 3 since
        assert h.add(s)
    assert offered_rate(h, {"a"}, start=-1, now=10)[0] == pytest.approx((20 + 30) / 10)
    assert offered_rate(h, {"a"}, start=-1, now=20)[0] == pytest.approx((40 + 33) / 20)
