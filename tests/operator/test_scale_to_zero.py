"""Scale to zero and back on the router's signal, and status.coldStart: the pure parts, no server."""

from __future__ import annotations

import pytest

from decodeservice.operator.autoscaler.scrape import ScrapeError
from decodeservice.operator.autoscaler.types import ClassMetrics, PodSample, ScaleDecision
from decodeservice.operator.autoscaler.zero import (
    IdleClock,
    RouterSignal,
    parse_router_metrics,
    with_router_signal,
)
from decodeservice.operator.cold_start import cold_start
from decodeservice.router.metrics import RouterMetrics

ROUTER_METRICS = """\
# TYPE decode_router:requests_held gauge
decode_router:requests_held{class="interactive"} 3
decode_router:requests_held{class="batch"} 2
# TYPE decode_router:last_request_timestamp_seconds gauge
decode_router:last_request_timestamp_seconds 1.7e9
# TYPE decode_router:endpoints gauge
decode_router:endpoints{state="ready"} 0
"""


def test_a_routers_metrics_give_held_requests_and_the_last_request() -> None:
    assert parse_router_metrics(ROUTER_METRICS) == (5.0, 1.7e9)
    metrics = RouterMetrics()  # the router's own exposition: the contract's names, summed over classes
    metrics.held.labels("interactive").set(3)
    metrics.held.labels("batch").set(2)
    metrics.last_request.set(1.7e9)
    assert parse_router_metrics(metrics.render(ready=0, known=2).decode()) == (5.0, 1.7e9)
    assert parse_router_metrics(RouterMetrics().render(ready=1, known=1).decode()) == (0.0, 0.0)


@pytest.mark.parametrize("body", [
    "decode_proxy:num_requests_running 0\n",  # a proxy, not a router
    "decode_router:requests_held -1\ndecode_router:last_request_timestamp_seconds 0\n",
    "decode_router:requests_held NaN\ndecode_router:last_request_timestamp_seconds 0\n",
    "\x00\xff garbage {{{",
])
def test_anything_else_is_refused(body: str) -> None:
    with pytest.raises(ScrapeError):
        parse_router_metrics(body)


def decision(current: int, desired: int | None = None) -> ScaleDecision:
    return ScaleDecision(at=1.0, current_replicas=current, desired_replicas=current if desired is None else desired,
                         reason="hold", signal=None, panic=False)


def signal(*, held: float = 0.0, last: float = 0.0, routers: int = 2) -> RouterSignal:
    return RouterSignal(held=held, last_request=last, routers=routers, failed=0)


def busy_pod(inflight: float) -> PodSample:
    return PodSample(pod="p", at=1.0, classes={"interactive": ClassMetrics(ttft=None, itl=None, queue_depth=0.0)},
                     inflight=inflight, kv_cache_usage=None, engine_waiting=None, engine_running=None)


def test_held_requests_start_one_replica_from_zero_at_once() -> None:
    d = with_router_signal(decision(0), signal=signal(held=3), idle_for=0.0, samples=(), min_replicas=0,
                           max_replicas=4, idle_seconds=60)
    assert d.desired_replicas == 1 and "scale from zero" in d.reason and "3 request(s) held" in d.reason
    quiet = with_router_signal(decision(0), signal=signal(), idle_for=500.0, samples=(), min_replicas=0,
                               max_replicas=4, idle_seconds=60)
    assert quiet.desired_replicas == 0


def test_a_starting_replica_is_not_missing_capacity_twice() -> None:
    # 0 -> 1 was written; the pod is not Ready, so the router still holds the requests: no second replica.
    d = with_router_signal(decision(1), signal=signal(held=7), idle_for=0.0, samples=(), min_replicas=0,
                           max_replicas=4, idle_seconds=60)
    assert d.desired_replicas == 1


def test_idle_routers_take_the_last_replicas_away_only_with_min_zero_and_nothing_in_flight() -> None:
    def after(idle_for: float, min_replicas: int) -> ScaleDecision:
        return with_router_signal(decision(2), signal=signal(last=1.0), idle_for=idle_for, samples=(),
                                  min_replicas=min_replicas, max_replicas=4, idle_seconds=60)

    assert after(61.0, 0).desired_replicas == 0 and "scaled to zero" in after(61.0, 0).reason
    assert after(59.0, 0).desired_replicas == 2 and after(61.0, 1).desired_replicas == 2
    streaming = with_router_signal(decision(1), signal=signal(last=1.0), idle_for=600.0, samples=(busy_pod(1),),
                                   min_replicas=0, max_replicas=4, idle_seconds=60)
    assert streaming.desired_replicas == 1  # a long stream started before the idle time: not idle
    unread = with_router_signal(decision(1), signal=signal(routers=0), idle_for=None, samples=(), min_replicas=0,
                                max_replicas=4, idle_seconds=60)
    assert unread.desired_replicas == 1  # no router read: never scale to zero on missing data
    rising = with_router_signal(decision(1, desired=2), signal=signal(), idle_for=600.0, samples=(),
                                min_replicas=0, max_replicas=4, idle_seconds=60)
    assert rising.desired_replicas == 2


def test_the_idle_clock_counts_from_the_last_request_or_from_when_the_routers_were_first_seen_quiet() -> None:
    now = [1000.0]
    clock = IdleClock(lambda: now[0])
    assert clock.idle_for(signal(last=900.0)) == 100.0
    assert clock.idle_for(signal(routers=0)) is None
    assert clock.idle_for(signal(last=0.0)) == 0.0  # restarted routers: quiet from now on
    now[0] = 1030.0
    assert clock.idle_for(signal(last=0.0)) == 30.0
    assert clock.idle_for(signal(last=1020.0)) == 10.0


def pod(name: str, created: str | None, ready_at: str | None, *, ready: bool = True,
        deleting: bool = False) -> dict[str, object]:
    meta: dict[str, object] = {"name": name}
    if created is not None:
        meta["creationTimestamp"] = created
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:10:00Z"
    conditions = [] if ready_at is None else [{"type": "Ready", "status": "True" if ready else "False",
                                               "lastTransitionTime": ready_at}]
    return {"metadata": meta, "status": {"conditions": conditions}}


def test_cold_start_is_creation_to_ready_of_the_newest_ready_pod() -> None:
    pods = [pod("a", "2026-01-01T00:00:00Z", "2026-01-01T00:01:30Z"),
            pod("b", "2026-01-01T00:05:00Z", "2026-01-01T00:05:42Z"),
            pod("c", "2026-01-01T00:06:00Z", "2026-01-01T00:07:00Z", ready=False),  # not Ready: not measured
            pod("d", "2026-01-01T00:06:00Z", None),  # starting
            pod("e", "2026-01-01T00:00:00Z", "2026-01-01T00:09:00Z", deleting=True),
            pod("f", None, "2026-01-01T00:09:00Z")]
    assert cold_start(pods) == {"lastSeconds": 42.0, "replicas": 2}
    assert cold_start(pods[2:]) is None
