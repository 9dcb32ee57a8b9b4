"""What one scrape yields and what one decision says: the autoscaler's typed vocabulary.

The scraping side (`scrape.py`) turns a pod's proxy `/metrics` text into a `PodSample`; the decision
side (`decide.py`) turns a `FleetObservation` per tick into a `ScaleDecision`. Neither imports the
other's internals, so the simulation benchmark can feed the decision side from a queueing model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class Histogram:
    """A cumulative Prometheus histogram as scraped (seconds)."""

    bounds: tuple[float, ...]  # ascending bucket upper bounds `le`; the last is +inf
    counts: tuple[float, ...]  # cumulative counts per bound, non-decreasing, same length as bounds
    total: float  # the `_count` series (equals counts[-1] when the body is consistent)


@dataclass(frozen=True, kw_only=True)
class ClassMetrics:
    """One priority class (`interactive`, `batch`, ...) as one pod's proxy reports it."""

    ttft: Histogram | None  # decode_proxy:time_to_first_token_seconds{class=...}
    itl: Histogram | None  # decode_proxy:inter_token_latency_seconds{class=...}
    queue_depth: float  # decode_proxy:num_requests_waiting{class=...}: queued for an upstream slot
    # decode_proxy:requests_shed_total{class=..., reason=slo|queue_full}, cumulative: turned away with 429
    # for want of capacity. Demand all the same; `tenant_rate` sheds are policy, not demand, and not counted.
    shed: float = 0.0


@dataclass(frozen=True, kw_only=True)
class PodSample:
    """One successful scrape of one ready pod's proxy `/metrics`."""

    pod: str
    at: float  # the operator's monotonic clock, seconds
    classes: Mapping[str, ClassMetrics]
    inflight: float  # decode_proxy:num_requests_running: in flight to the engine
    kv_cache_usage: float | None  # the engine's vllm:kv_cache_usage_perc (a 0..1 fraction), relayed
    engine_waiting: float | None  # the engine's vllm:num_requests_waiting, relayed
    engine_running: float | None  # the engine's vllm:num_requests_running, relayed


@dataclass(frozen=True, kw_only=True)
class FleetObservation:
    """Everything one tick saw for one DecodeService."""

    at: float  # monotonic seconds, same clock as PodSample.at
    current_replicas: int  # the Deployment's spec.replicas now
    samples: Sequence[PodSample]  # ready pods scraped successfully this tick
    failed_pods: Sequence[str] = ()  # ready pods whose scrape failed or was unparseable
    starting_pods: int = 0  # pods that exist but are not ready yet: capacity on its way


@dataclass(frozen=True, kw_only=True)
class ClassStatus:
    """Per class, over the stable window: what status.slo reports."""

    ttft_seconds: float | None  # observed p-th percentile TTFT (None: no requests in the window)
    itl_seconds: float | None  # observed p-th percentile ITL
    ttft_attainment: float | None  # share of first tokens within ttftMs (from bucket deltas)
    itl_attainment: float | None  # share of token gaps within itlMs
    signal: float | None  # max(ttft / ttftMs, itl / itlMs)
    requests: float  # first tokens observed in the window


@dataclass(frozen=True, kw_only=True)
class ScaleDecision:
    at: float
    current_replicas: int
    desired_replicas: int
    reason: str  # one human line: why (goes into the Event and the log)
    signal: float | None  # the worst class's signal that drove the decision (None: no data)
    panic: bool
    classes: Mapping[str, ClassStatus] = field(default_factory=dict)
    scraped_pods: int = 0
    failed_pods: int = 0

    @property
    def changed(self) -> bool:
        return self.desired_replicas != self.current_replicas
