"""The autoscaler's knobs, checked when built: one `AutoscalerSettings` per DecodeService.

The operator maps `spec.autoscaling` and the SLO policy onto these (operator/autoscaler/controller.py);
every knob has a default and a one-line reason. `decide.py` reads them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class Objective:
    """One class's latency objectives, seconds."""

    ttft_seconds: float
    itl_seconds: float


@dataclass(frozen=True, kw_only=True)
class AutoscalerSettings:
    min_replicas: int
    max_replicas: int
    ttft_seconds: float  # the SLO objectives (policy.slo.ttftMs / itlMs, in seconds)
    itl_seconds: float
    percentile: float = 95.0  # policy.slo.percentile
    # Classes whose objectives differ from the two above (say a looser batch TTFT); others use those.
    class_objectives: Mapping[str, Objective] = field(default_factory=dict)
    interval_seconds: float = 5.0  # how often the operator ticks
    stable_window_seconds: float = 60.0  # Knative's stable window: enough requests for a p95
    panic_window_seconds: float = 6.0  # about one tick: sees a burst as soon as it is scraped
    # s above this: scale up, before the knee at 1.0 where latency goes vertical. 0.9, not lower: the rate
    # sizes the fleet, so s is the correction, and each 0.1 of margin under the knee costs about a tenth
    # more replicas at steady state (benchmarks/autoscale_sim.py: 0.8 held ~1 pod more than the
    # peak-sized fleet at constant load; 0.9 matched it, with the same attainment).
    scale_up_threshold: float = 0.9
    scale_down_threshold: float = 0.6  # s below this (and the projection on fewer pods holds): may go down
    target_inflight_per_replica: int = 16  # demand guard (CRD: autoscaling.targetInflightPerReplica)
    kv_usage_threshold: float = 0.8  # saturation guard: a fuller KV cache preempts and queues
    waiting_threshold: float = 4.0  # saturation guard: engine waiting requests per pod
    tolerance: float = 0.1  # the HPA's: demand within 10% of target changes nothing (noise)
    scale_up_stabilization_seconds: float = 0.0  # as the HPA: a breach is answered on the tick it shows
    scale_down_stabilization_seconds: float = 300.0  # CRD: autoscaling.scaleDownDelaySeconds
    max_scale_up_step: int = 4  # HPA default: up by 4 pods or ...
    max_scale_up_ratio: float = 1.0  # ... 100% of current, whichever is more, ...
    scale_up_period_seconds: float = 15.0  # ... per 15 s (HPA periodSeconds), so 5-s ticks do not compound
    max_scale_down_ratio: float = 0.5  # at most half the pods go in one decision (at least one may)
    panic_threshold: float = 2.0  # Knative's 200%: short-window demand or s twice the up point
    min_panic_observations: int = 20  # a short-window p95 of fewer requests is one outlier, not a burst
    max_observations_per_second: float = 1e6  # a pod claiming more per second is lying; its delta is dropped
    # A proxy holds at most admission.maxInflight plus its class queues (64 + 64 + 256 by default); a pod
    # claiming more in flight + queued (or engine waiting) is lying, and is counted as failed.
    max_pod_demand: float = 384.0
    # Latency has a floor (an idle engine's step, a prefill stall) that fewer replicas do not raise: the
    # projection scales only the part of s above the lowest stable signal seen over this long.
    floor_memory_seconds: float = 1800.0
    # Rate sizing (capacity.py): replicas = (offered rate + waiting line / drain) / (learned rate per
    # replica x utilization). The learned rate is the knee's (s at the up threshold), so 0.95 leaves room
    # for Poisson noise over a window. The waiting line piled up during a cold start is drained over three
    # minutes, about an LLM pod's own cold start (image, weights, warm-up): a pod ordered for the line helps
    # no sooner, so a shorter horizon orders pods that start after the line is gone: on sudden bursts a
    # 60 s horizon held more replica-minutes for the same attainment (benchmarks/autoscale_sim.py).
    target_utilization: float = 0.95
    backlog_drain_seconds: float = 180.0

    def __post_init__(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(f"invalid autoscaler settings: {msg}")

        def pos(name: str) -> None:
            v = getattr(self, name)
            need(isinstance(v, int | float) and math.isfinite(v) and v > 0, f"{name} must be > 0, got {v!r}")

        need(isinstance(self.min_replicas, int) and self.min_replicas >= 0,
             f"min_replicas must be an integer >= 0, got {self.min_replicas!r}")
        need(isinstance(self.max_replicas, int) and self.max_replicas >= 1,
             f"max_replicas must be an integer >= 1, got {self.max_replicas!r}")
        need(self.min_replicas <= self.max_replicas,
             f"min_replicas ({self.min_replicas}) must be <= max_replicas ({self.max_replicas})")
        for name in ("ttft_seconds", "itl_seconds", "interval_seconds", "stable_window_seconds",
                     "panic_window_seconds", "scale_up_threshold", "scale_down_threshold",
                     "target_inflight_per_replica", "kv_usage_threshold", "waiting_threshold",
                     "max_scale_up_step", "max_scale_up_ratio", "max_scale_down_ratio", "panic_threshold",
                     "max_observations_per_second", "floor_memory_seconds", "max_pod_demand",
                     "target_utilization", "backlog_drain_seconds"):
            pos(name)
        need(0 < self.percentile < 100, f"percentile must be in (0, 100), got {self.percentile}")
        need(self.scale_down_threshold < self.scale_up_threshold,
             f"scale_down_threshold ({self.scale_down_threshold}) must be < scale_up_threshold "
             f"({self.scale_up_threshold}): the band between them is the hysteresis")
        need(self.panic_window_seconds <= self.stable_window_seconds,
             "panic_window_seconds must be <= stable_window_seconds")
        need(self.kv_usage_threshold <= 1.0, f"kv_usage_threshold is a fraction <= 1, got {self.kv_usage_threshold}")
        need(self.target_utilization <= 1, f"target_utilization must be <= 1, got {self.target_utilization}")
        need(0 <= self.tolerance < 1, f"tolerance must be in [0, 1), got {self.tolerance}")
        need(self.max_scale_down_ratio <= 1, f"max_scale_down_ratio must be <= 1, got {self.max_scale_down_ratio}")
        need(isinstance(self.max_scale_up_step, int), "max_scale_up_step must be an integer")
        need(isinstance(self.min_panic_observations, int) and self.min_panic_observations >= 1,
             "min_panic_observations must be an integer >= 1")
        for name in ("scale_up_stabilization_seconds", "scale_down_stabilization_seconds",
                     "scale_up_period_seconds"):
            v = getattr(self, name)
            need(math.isfinite(v) and v >= 0, f"{name} must be >= 0, got {v}")
        for cls, obj in self.class_objectives.items():
            need(obj.ttft_seconds > 0 and obj.itl_seconds > 0, f"class {cls!r}: objectives must be > 0")

    def objective(self, cls: str) -> Objective:
        return self.class_objectives.get(cls) or Objective(ttft_seconds=self.ttft_seconds,
                                                           itl_seconds=self.itl_seconds)
