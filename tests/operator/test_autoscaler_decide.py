"""The autoscaler's decisions, tick by tick, from controlled per-pod histograms (pure, no server)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from decodeservice.operator.autoscaler.decide import Autoscaler, AutoscalerSettings, Objective
from decodeservice.operator.autoscaler.types import (
    ClassMetrics,
    FleetObservation,
    Histogram,
    PodSample,
    ScaleDecision,
)
from decodeservice.proxy.metrics import ITL_BUCKETS, TTFT_BUCKETS

TTFT_BOUNDS = (*TTFT_BUCKETS, math.inf)
ITL_BOUNDS = (*ITL_BUCKETS, math.inf)
TICK = 5.0


def base(**kw: object) -> AutoscalerSettings:
    args: dict[str, object] = {"min_replicas": 1, "max_replicas": 10, "ttft_seconds": 1.0, "itl_seconds": 0.2}
    args.update(kw)
    return AutoscalerSettings(**args)  # type: ignore[arg-type]


@dataclass
class _Pod:
    ttft: list[float] = field(default_factory=lambda: [0.0] * len(TTFT_BOUNDS))
    itl: list[float] = field(default_factory=lambda: [0.0] * len(ITL_BOUNDS))

    def observe(self, ttft: float, itl: float, requests: int) -> None:
        for counts, bounds, value, n in ((self.ttft, TTFT_BOUNDS, ttft, requests),
                                         (self.itl, ITL_BOUNDS, itl, 10 * requests)):
            for i, b in enumerate(bounds):
                if value <= b:
                    counts[i] += n  # cumulative: every bucket at or above the value


class Fleet:
    """Pods whose proxies serve cumulative histograms, and a Deployment that follows the decisions."""

    def __init__(self, scaler: Autoscaler, replicas: int) -> None:
        self.scaler, self.replicas, self.now = scaler, replicas, 0.0
        self.pods: dict[str, _Pod] = {}
        self.serial = 0
        self.decisions: list[ScaleDecision] = []

    def tick(self, *, ttft: float, itl: float, inflight: float, requests: int = 20, queue: float = 0.0,
             starting: int = 0, failed: tuple[str, ...] = (), extra: tuple[PodSample, ...] = (),
             follow: bool = True) -> ScaleDecision:
        """One interval: each ready pod answered `requests` at these latencies and holds `inflight`."""
        self.now += TICK
        ready = self.replicas - starting
        while len(self.pods) < ready:
            self.serial += 1
            self.pods[f"pod-{self.serial}"] = _Pod()
        while len(self.pods) > ready:
            self.pods.pop(next(reversed(self.pods)))
        samples = []
        for name, pod in self.pods.items():
            pod.observe(ttft, itl, requests)
            if name in failed:
                continue
            samples.append(PodSample(
                pod=name, at=self.now, inflight=inflight, kv_cache_usage=0.2, engine_waiting=0.0,
                engine_running=inflight,
                classes={"interactive": ClassMetrics(
                    ttft=Histogram(bounds=TTFT_BOUNDS, counts=tuple(pod.ttft), total=pod.ttft[-1]),
                    itl=Histogram(bounds=ITL_BOUNDS, counts=tuple(pod.itl), total=pod.itl[-1]),
                    queue_depth=queue)}))
        d = self.scaler.decide(FleetObservation(at=self.now, current_replicas=self.replicas,
                                                samples=[*samples, *extra], failed_pods=failed,
                                                starting_pods=starting))
        assert d.reason
        self.decisions.append(d)
        if follow:
            self.replicas = d.desired_replicas
        return d

    def run(self, ticks: int, **kw: object) -> list[ScaleDecision]:
        return [self.tick(**kw) for _ in range(ticks)]  # type: ignore[arg-type]


HEALTHY = {"ttft": 0.2, "itl": 0.04}  # s = 0.2 (both objectives far away)
EDGE = {"ttft": 0.55, "itl": 0.09}  # s ~ 0.55: inside the band


def reversals(ds: list[ScaleDecision]) -> int:
    dirs = [1 if d.desired_replicas > d.current_replicas else -1 for d in ds if d.changed]
    return sum(1 for a, b in zip(dirs, dirs[1:], strict=False) if a != b)


def test_breach_scales_up_on_the_tick_it_shows() -> None:
    f = Fleet(Autoscaler(base()), 2)
    assert all(not d.changed for d in f.run(20, **HEALTHY, inflight=8))
    d = f.tick(ttft=3.0, itl=0.3, inflight=12, requests=200)
    assert d.desired_replicas > 2 and d.reason.startswith("2 -> ")
    assert d.signal is not None and d.signal > 1
    assert d.classes["interactive"].ttft_attainment is not None


def test_recovery_scales_down_only_after_the_stabilization_window() -> None:
    f = Fleet(Autoscaler(base(scale_down_stabilization_seconds=300)), 2)
    f.run(20, **HEALTHY, inflight=8)
    f.run(3, ttft=3.0, itl=0.3, inflight=14, requests=200)
    peak = f.replicas
    last_up = f.now
    assert peak > 2
    calm = f.run(120, ttft=0.1, itl=0.02, inflight=1, requests=5)
    downs = [d for d in calm if d.desired_replicas < d.current_replicas]
    assert downs, "never scaled back down"
    assert downs[0].at >= last_up + 300
    assert f.replicas < peak and reversals(f.decisions) <= 1


def test_flapping_metrics_never_oscillate_replicas() -> None:
    f = Fleet(Autoscaler(base()), 2)
    f.run(20, **HEALTHY, inflight=6)
    for i in range(120):  # ten minutes of breach / calm on alternate ticks
        f.tick(**(dict(ttft=1.5, itl=0.25) if i % 2 else HEALTHY), inflight=6)
    assert reversals(f.decisions) == 0


@pytest.mark.parametrize("inflight", [13.0, 14.5, 16.0])
def test_constant_load_at_the_edge_never_flaps(inflight: float) -> None:
    f = Fleet(Autoscaler(base()), 3)
    f.run(360, **EDGE, inflight=inflight)  # 30 minutes
    assert reversals(f.decisions) == 0
    assert sum(d.changed for d in f.decisions) <= 1


def test_the_projection_onto_fewer_replicas_refuses_a_breach_of_the_down_threshold() -> None:
    f = Fleet(Autoscaler(base()), 3)
    f.run(20, **HEALTHY, inflight=4)  # s = 0.2 at first: the floor
    ds = f.run(120, ttft=0.2, itl=0.09, inflight=4)  # p95 ITL ~0.099 s: s ~0.49 < 0.5, demand fits one
    # replica, but 0.2 + (0.49 - 0.2) x 3/2 = 0.64 on two: hold
    assert not any(d.changed for d in ds)
    assert "load projected onto 2 replicas would breach a down threshold" in ds[-1].reason


def test_constant_light_load_goes_down_once_and_stays() -> None:
    f = Fleet(Autoscaler(base()), 6)
    f.run(360, **HEALTHY, inflight=3)
    assert f.replicas < 6 and reversals(f.decisions) == 0


def test_a_burst_triggers_panic_and_no_scale_down_during_it() -> None:
    f = Fleet(Autoscaler(base()), 2)
    f.run(20, **HEALTHY, inflight=6)
    d = f.tick(**HEALTHY, inflight=64, queue=20)  # demand 84 per pod: 10x the 16 target in one tick
    assert d.panic and d.desired_replicas > 2
    top = f.replicas
    after = f.run(10, **HEALTHY, inflight=1)  # the burst ends at once: panic still holds
    assert all(x.panic for x in after)
    assert all(x.desired_replicas >= x.current_replicas for x in after) and f.replicas == top


def test_starting_pods_count_as_capacity() -> None:
    f = Fleet(Autoscaler(base()), 2)
    f.run(20, **HEALTHY, inflight=8)
    # Demand 60 on the two ready pods: 4 replicas; new pods stay starting (100 s and more), the load stays.
    ds = [f.tick(**HEALTHY, inflight=30, starting=f.replicas - 2) for _ in range(40)]
    assert max(d.desired_replicas for d in ds) == 4 == f.replicas
    assert ds[-1].reason.startswith("hold: ")


def test_failed_and_garbage_pods_are_counted_and_never_block() -> None:
    f = Fleet(Autoscaler(base()), 3)
    f.run(20, **HEALTHY, inflight=8)
    hostile = PodSample(pod="pod-x", at=f.now + TICK, inflight=1e30, kv_cache_usage=math.nan,
                        engine_waiting=-5, engine_running=None, classes={})
    d = f.tick(ttft=3.0, itl=0.3, inflight=12, requests=200, failed=("pod-1",), extra=(hostile,))
    assert d.failed_pods == 2 and d.scraped_pods == 2
    assert d.desired_replicas > 3


@pytest.mark.parametrize("inflight", [9e99, 5000.0])
def test_garbage_alone_never_scales_to_max(inflight: float) -> None:
    f = Fleet(Autoscaler(base()), 2)
    f.run(20, **HEALTHY, inflight=4)
    huge = Histogram(bounds=TTFT_BOUNDS, counts=(0.0,) * (len(TTFT_BOUNDS) - 1) + (1e300,), total=1e300)
    for _ in range(20):
        # absurd counts, or a number of requests in flight no proxy admits (over max_pod_demand)
        liar = PodSample(pod="liar", at=f.now + TICK, inflight=inflight, kv_cache_usage=0.5, engine_waiting=0,
                         engine_running=0, classes={"interactive": ClassMetrics(ttft=huge if inflight > 1e9 else None, itl=None,
                                                              queue_depth=0)})
        d = f.tick(**HEALTHY, inflight=4, extra=(liar,))
        assert d.desired_replicas == 2 and d.failed_pods == 1


def test_min_and_max_hold() -> None:
    f = Fleet(Autoscaler(base(max_replicas=3)), 2)
    f.run(20, **HEALTHY, inflight=8)
    assert max(d.desired_replicas for d in f.run(10, ttft=9.0, itl=1.0, inflight=60, requests=200)) == 3
    g = Fleet(Autoscaler(base(min_replicas=2)), 4)
    g.run(200, ttft=0.05, itl=0.01, inflight=0, requests=1)
    assert g.replicas == 2


def test_no_data_keeps_replicas_and_out_of_bounds_is_clamped() -> None:
    scaler = Autoscaler(base(max_replicas=4))
    d = scaler.decide(FleetObservation(at=1.0, current_replicas=3, samples=[], failed_pods=["a", "b"]))
    assert d.desired_replicas == 3 and d.signal is None and d.failed_pods == 2 and "no metrics" in d.reason
    d = scaler.decide(FleetObservation(at=2.0, current_replicas=7, samples=[]))
    assert d.desired_replicas == 4


def test_update_settings_keeps_history() -> None:
    scaler = Autoscaler(base())
    f = Fleet(scaler, 2)
    f.run(20, **HEALTHY, inflight=8)
    scaler.update_settings(base(max_replicas=5, itl_seconds=0.1))
    d = f.tick(**HEALTHY, inflight=8)
    assert d.signal == pytest.approx(0.4, rel=0.3)  # the ITL objective halved; the window is still there


def test_class_objectives_apply_per_class() -> None:
    s = base(class_objectives={"batch": Objective(ttft_seconds=10.0, itl_seconds=1.0)})
    assert s.objective("batch").ttft_seconds == 10.0 and s.objective("interactive").ttft_seconds == 1.0


@pytest.mark.parametrize(("kw", "words"), [
    ({"min_replicas": 5, "max_replicas": 2}, "min_replicas (5) must be <= max_replicas (2)"),
    ({"ttft_seconds": 0.0}, "ttft_seconds must be > 0"),
    ({"scale_down_threshold": 0.9}, "must be < scale_up_threshold"),
    ({"percentile": 100.0}, "percentile must be in (0, 100)"),
    ({"itl_seconds": math.nan}, "itl_seconds must be > 0"),
    ({"kv_usage_threshold": 1.5}, "kv_usage_threshold is a fraction"),
    ({"scale_down_stabilization_seconds": -1.0}, "scale_down_stabilization_seconds must be >= 0"),
])
def test_settings_reject_bad_values_with_a_clear_message(kw: dict[str, object], words: str) -> None:
    with pytest.raises(ValueError, match="invalid autoscaler settings") as err:
        base(**kw)
    assert words in str(err.value)


_floats = st.floats(allow_nan=True, allow_infinity=True, width=64)
_counts = st.lists(_floats, min_size=0, max_size=5)


@st.composite
def _samples(draw: st.DrawFn) -> PodSample:
    def h() -> Histogram | None:
        counts = draw(_counts)
        if draw(st.booleans()):
            counts = sorted(abs(c) for c in counts if math.isfinite(c))
        bounds = draw(st.sampled_from([TTFT_BOUNDS[-len(counts):] if counts else (), (0.1, 0.2, math.inf)[:len(counts)],
                                       tuple(draw(st.lists(_floats, min_size=len(counts), max_size=len(counts))))]))
        return draw(st.none() | st.just(Histogram(bounds=bounds, counts=tuple(counts), total=draw(_floats))))

    return PodSample(pod=draw(st.sampled_from(["a", "b", "c"])), at=draw(_floats | st.floats(0, 100)),
                     classes={c: ClassMetrics(ttft=h(), itl=h(), queue_depth=draw(_floats))
                              for c in draw(st.lists(st.sampled_from(["interactive", "batch"]), max_size=2))},
                     inflight=draw(_floats), kv_cache_usage=draw(st.none() | _floats),
                     engine_waiting=draw(st.none() | _floats), engine_running=draw(st.none() | _floats))


@settings(max_examples=60, deadline=None)
@given(ticks=st.lists(st.tuples(st.lists(_samples(), max_size=4), st.integers(0, 40), st.integers(0, 5),
                                st.lists(st.sampled_from(["a", "b", "x"]), max_size=2)), min_size=1, max_size=12),
       lo=st.integers(0, 3), span=st.integers(0, 6))
def test_never_raises_and_stays_within_bounds(ticks: list[tuple[list[PodSample], int, int, list[str]]],
                                              lo: int, span: int) -> None:
    scaler = Autoscaler(base(min_replicas=lo, max_replicas=max(lo + span, 1)))
    for i, (samples, current, starting, failed) in enumerate(ticks):
        d = scaler.decide(FleetObservation(at=5.0 * (i + 1), current_replicas=current, samples=samples,
                                           failed_pods=failed, starting_pods=starting))
        assert lo <= d.desired_replicas <= max(lo + span, 1)


def test_a_breach_reveals_the_rate_per_replica_and_the_fleet_is_sized_on_the_offered_rate() -> None:
    f = Fleet(Autoscaler(base()), 2)
    f.run(20, **HEALTHY, inflight=4)  # 20 first tokens per pod per 5 s: 4 req/s each, 8 in all
    assert f.scaler.rate_capacity is None  # flat latency: the knee is not known yet
    d = f.tick(ttft=1.5, itl=0.09, inflight=8)  # the same rate, now over the up threshold
    cap = f.scaler.rate_capacity
    up, util = f.scaler.settings.scale_up_threshold, f.scaler.settings.target_utilization
    assert cap is not None and 4.0 * up / 2 <= cap <= 4.0  # 4 req/s x up / s, s counted in [up, 2 x up]
    # Sized on the rate: 8 req/s over the stable window, or (the short window's s is over twice the up
    # point: panic) the short window's rate, which adds this tick's 4 more in flight: at most 12 req/s.
    assert math.ceil(8.0 / (cap * util)) <= d.desired_replicas <= math.ceil(12.0 / (cap * util))


def test_a_small_fleet_with_a_learned_rate_still_comes_down_when_latency_vouches() -> None:
    # A breach teaches a low knee; afterwards the same offered rate runs with flat latency. The learned
    # rate rises only by 1.5x the rate a pod takes, so on its own it would hold 3 pods forever at a load
    # that latency says 1 pod carries; the latency projection steps down, and no rate sizing undoes it.
    f = Fleet(Autoscaler(base(max_replicas=3, scale_down_stabilization_seconds=10.0)), 3)
    f.run(4, **HEALTHY, inflight=2, requests=4)
    f.tick(ttft=2.0, itl=0.09, inflight=2, requests=4)  # 0.8 req/s per pod at s = 2: knee ~0.32 req/s
    assert f.scaler.rate_capacity is not None and f.scaler.rate_capacity < 0.8
    total = 12  # first tokens per tick over the fleet: 2.4 req/s whatever the replica count
    decisions = [f.tick(ttft=0.12, itl=0.02, inflight=1, requests=total // f.replicas) for _ in range(80)]
    assert f.replicas < 3, decisions[-1].reason
    downs = [d for d in decisions if d.desired_replicas < d.current_replicas]
    assert downs and all("learned rate raised" in d.reason or "fit" in d.reason for d in downs)
    assert reversals(decisions[-40:]) == 0


def _after_a_cold_start(per_pod_queue_after: list[float]) -> tuple[Fleet, list[ScaleDecision]]:
    """A learned rate, six pods sized for the load; the line grew while two of them were starting."""
    f = Fleet(Autoscaler(base(max_replicas=20)), 2)
    f.run(20, **HEALTHY, inflight=4)
    f.tick(ttft=1.5, itl=0.09, inflight=8)  # a breach teaches the rate one pod sustains
    f.replicas = 6
    f.run(20, **HEALTHY, inflight=3, requests=9, follow=False)  # 10.8 req/s: six pods' worth
    slow = {"ttft": 1.5, "itl": 0.09, "inflight": 8.0, "requests": 9, "follow": False}
    ds = [f.tick(**slow, queue=q, starting=2) for q in (4.0, 8.0, 12.0)]  # type: ignore[arg-type]
    ds += [f.tick(**slow, queue=q) for q in per_pod_queue_after]  # type: ignore[arg-type]
    return f, ds


def test_latency_of_a_line_being_drained_asks_for_no_pods_and_teaches_nothing() -> None:
    # Once the two pods are ready, the line (48 requests on four pods) shrinks on six: TTFT stays over the
    # up point while the old requests are served, but the ready pods carry the rate. A pod ordered now
    # would start after the line is gone, and the knee did not move.
    f, ds = _after_a_cold_start([7.0, 5.0, 3.0, 1.0])
    learned = f.scaler.rate_capacity
    assert all(d.desired_replicas == 6 for d in ds), [d.reason for d in ds]
    f2, _ = _after_a_cold_start([])
    assert learned == f2.scaler.rate_capacity


def test_latency_with_a_growing_line_still_scales_up() -> None:
    _, ds = _after_a_cold_start([15.0, 18.0, 21.0, 24.0])  # the line grows on six ready pods: they are short
    assert all(d.desired_replicas > 6 for d in ds[3:]), [d.reason for d in ds]
