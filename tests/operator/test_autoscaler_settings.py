"""spec.autoscaling and spec.policies.slo -> AutoscalerSettings, and status.slo -> SLOMet."""

from __future__ import annotations

from typing import Any

import pytest

from decodeservice.operator.autoscaler.controller import AutoscalingConfig, settings_for
from decodeservice.operator.autoscaler.decide import AutoscalerSettings
from decodeservice.operator.errors import InvalidSpecError
from decodeservice.operator.spec import validate_spec
from decodeservice.operator.status import slo_condition, with_condition


def spec(**autoscaling: Any) -> dict[str, Any]:
    return {"model": {"uri": "bundled://smollm2-135m"}, "policies": {"slo": {"ttftMs": 500, "itlMs": 50,
                                                                              "percentile": 99}},
            "autoscaling": {"mode": "builtin", "minReplicas": 2, "maxReplicas": 9, **autoscaling}}


def test_every_knob_reaches_the_settings() -> None:
    knobs = {"intervalSeconds": 2.5, "stableWindowSeconds": 40, "panicWindowSeconds": 4, "scaleUpThreshold": 0.9,
             "scaleDownThreshold": 0.4, "kvUsageThreshold": 0.7, "waitingThreshold": 3,
             "targetInflightPerReplica": 24, "scaleDownDelaySeconds": 120}
    s = settings_for(validate_spec(spec(**knobs)), default_interval=5.0)
    assert (s.min_replicas, s.max_replicas, s.ttft_seconds, s.itl_seconds, s.percentile) == (2, 9, 0.5, 0.05, 99)
    assert (s.interval_seconds, s.stable_window_seconds, s.panic_window_seconds) == (2.5, 40, 4)
    assert (s.scale_up_threshold, s.scale_down_threshold, s.kv_usage_threshold, s.waiting_threshold) == (
        0.9, 0.4, 0.7, 3)
    assert (s.target_inflight_per_replica, s.scale_down_stabilization_seconds) == (24, 120.0)


def test_unset_knobs_keep_the_decision_sides_defaults() -> None:
    s = settings_for(validate_spec(spec()), default_interval=AutoscalingConfig().interval_seconds)
    defaults = AutoscalerSettings(min_replicas=2, max_replicas=9, ttft_seconds=0.5, itl_seconds=0.05)
    for name in ("stable_window_seconds", "panic_window_seconds", "scale_up_threshold", "scale_down_threshold",
                 "kv_usage_threshold", "waiting_threshold"):
        assert getattr(s, name) == getattr(defaults, name), name
    assert s.interval_seconds == 5.0  # the operator's default (decodectl operator --autoscale-interval-seconds)


def test_a_combination_the_settings_refuse_is_an_invalid_spec() -> None:
    # Each threshold is valid alone; against the other's default (up at 0.9) the band is inverted.
    with pytest.raises(InvalidSpecError, match="spec.autoscaling: .*scale_down_threshold"):
        settings_for(validate_spec(spec(scaleDownThreshold=0.9)), default_interval=5.0)
    with pytest.raises(ValueError, match="interval_seconds"):
        AutoscalingConfig(interval_seconds=0)


@pytest.mark.parametrize(("slo", "expected"), [
    ({"attainment": 0.99}, ("True", "ObjectivesMet")),
    ({"attainment": 0.5}, ("False", "ObjectivesMissed")),
    ({"scrapedPods": 0, "failedPods": 2}, ("Unknown", "MetricsUnavailable")),
    ({"scrapedPods": 2, "failedPods": 0}, ("Unknown", "NoMeasurements")),
    ({}, ("Unknown", "NoMeasurements")),
])
def test_slo_condition(slo: dict[str, Any], expected: tuple[str, str]) -> None:
    assert slo_condition(slo, 95.0)[:2] == expected


def test_with_condition_keeps_the_others_and_moves_time_only_on_change() -> None:
    previous = {"conditions": [
        {"type": "Ready", "status": "True", "reason": "AllReplicasReady", "message": "", "lastTransitionTime": "t0",
         "observedGeneration": 1},
        {"type": "SLOMet", "status": "True", "reason": "ObjectivesMet", "message": "a", "lastTransitionTime": "t0",
         "observedGeneration": 1}]}
    same = with_condition(previous, "SLOMet", ("True", "ObjectivesMet", "b"), generation=1, now="t1")
    assert [c["type"] for c in same] == ["Ready", "SLOMet"]
    assert same[1]["lastTransitionTime"] == "t0" and same[1]["message"] == "b"
    flipped = with_condition(previous, "SLOMet", ("False", "ObjectivesMissed", "c"), generation=2, now="t2")
    assert flipped[1]["lastTransitionTime"] == "t2" and flipped[0] == previous["conditions"][0]
