"""Prometheus metrics of the proxy, named like vLLM's under the `decode_proxy:` prefix.

Every name is documented in `proxy/METRICS.md`. Each app owns its own `CollectorRegistry` (no global
state), served at the proxy's GET /metrics.
"""

from __future__ import annotations

import dataclasses
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from decodeservice.proxy.policy import Policy, PriorityClass
from decodeservice.proxy.slo import LatencyModel, RequestOutcome, SloTracker

PREFIX = "decode_proxy:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0)
_WAIT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ClassMetrics:
    """One class's labelled children, bound once: `.labels()` hashes and locks on every call."""

    ttft: Histogram
    itl: Histogram
    tpot: Histogram
    e2e: Histogram
    queue_time: Histogram
    window_hold: Histogram
    waiting: Gauge
    held: Gauge
    clamped: Counter
    generation_tokens: Counter


class ProxyMetrics:
    """The proxy's metrics plus the sliding windows behind the SLO gauges and the admission model."""

    def __init__(self, policy: Policy):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        cls = ["class"]
        self.ttft = Histogram(f"{PREFIX}time_to_first_token_seconds",
                              "Arrival at the proxy to the first token event, per class.", cls,
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(f"{PREFIX}inter_token_latency_seconds",
                             "Gap between consecutive token events of a stream.", cls,
                             buckets=ITL_BUCKETS, registry=r)
        self.tpot = Histogram(f"{PREFIX}time_per_output_token_seconds",
                              "(e2e - TTFT) / (output tokens - 1) per request.", cls,
                              buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(f"{PREFIX}e2e_request_latency_seconds",
                             "Arrival at the proxy to the last byte sent to the client.", cls,
                             buckets=_E2E_BUCKETS, registry=r)
        self.queue_time = Histogram(f"{PREFIX}request_queue_time_seconds",
                                    "Time waiting in the class queue for an upstream slot.", cls,
                                    buckets=_WAIT_BUCKETS, registry=r)
        self.window_hold = Histogram(f"{PREFIX}batch_window_hold_seconds",
                                     "Time held by the batching window before release.", cls,
                                     buckets=_WAIT_BUCKETS, registry=r)
        self.slo_attainment = Gauge(f"{PREFIX}slo_attainment_ratio",
                                    "Fraction of requests in the sliding window meeting the objective "
                                    "(1 when the window is empty).", ["class", "objective"], registry=r)
        self.slo_target = Gauge(f"{PREFIX}slo_target_ratio",
                                "The configured percentile as a ratio (compare attainment to it).", registry=r)
        self.waiting = Gauge(f"{PREFIX}num_requests_waiting",
                             "Requests queued for an upstream slot, per class.", cls, registry=r)
        self.running = Gauge(f"{PREFIX}num_requests_running",
                             "Requests in flight to the upstream.", registry=r)
        self.held = Gauge(f"{PREFIX}num_requests_held",
                          "Requests held by the batching window, per class.", cls, registry=r)
        self.requests = Counter(f"{PREFIX}requests", "Requests answered, by class and HTTP status.",
                                ["class", "status"], registry=r)
        self.shed = Counter(f"{PREFIX}requests_shed", "Requests shed with 429, by class and reason "
                            "(slo, queue_full, tenant_rate).", ["class", "reason"], registry=r)
        self.clamped = Counter(f"{PREFIX}requests_clamped",
                               "Requests whose output limit was lowered to maxOutputTokens.", cls, registry=r)
        self.rejected = Counter(f"{PREFIX}requests_rejected",
                                "Requests refused as invalid (400/413), by reason.", ["reason"], registry=r)
        self.generation_tokens = Counter(f"{PREFIX}generation_tokens",
                                         "Output tokens relayed to clients.", cls, registry=r)
        # Good/total counters per objective: burn-rate alerts take rates of these over any window, which
        # the attainment gauge (one fixed window, per pod) cannot give.
        self.slo_requests = Counter(f"{PREFIX}slo_requests",
                                    "Finished requests judged against each objective, by outcome (met, missed).",
                                    ["class", "objective", "outcome"], registry=r)
        self._slo_outcomes = {(p, objective, met): self.slo_requests.labels(p.value, objective,
                                                                             "met" if met else "missed")
                              for p in PriorityClass for objective in ("ttft", "itl") for met in (True, False)}
        self.upstream_errors = Counter(f"{PREFIX}upstream_errors",
                                       "Upstream failures: unreachable, died mid-stream, timeout.",
                                       ["kind"], registry=r)
        self.for_class = {p: ClassMetrics(
            ttft=self.ttft.labels(p.value), itl=self.itl.labels(p.value), tpot=self.tpot.labels(p.value),
            e2e=self.e2e.labels(p.value), queue_time=self.queue_time.labels(p.value),
            window_hold=self.window_hold.labels(p.value), waiting=self.waiting.labels(p.value),
            held=self.held.labels(p.value), clamped=self.clamped.labels(p.value),
            generation_tokens=self.generation_tokens.labels(p.value),
        ) for p in PriorityClass}
        self._answered: dict[tuple[str, int], Counter] = {}
        self.slo_target.set(policy.slo.percentile / 100.0)
        self.tracker = SloTracker(policy.slo)
        self.latency = LatencyModel(window_seconds=policy.slo.window_seconds)
        self._refresh_attainment(time.perf_counter())

    def answered(self, cls: str, status: int) -> Counter:
        """The `requests` child for this class and status, bound on first use."""
        child = self._answered.get((cls, status))
        if child is None:
            child = self._answered[(cls, status)] = self.requests.labels(cls, str(status))
        return child

    def record(self, outcome: RequestOutcome) -> None:
        m = self.for_class[outcome.priority]
        if outcome.ttft is not None:
            m.ttft.observe(outcome.ttft)
        itl = m.itl
        for gap in outcome.itls:
            itl.observe(gap)
        if outcome.ttft is not None and outcome.output_tokens > 1:
            m.tpot.observe((outcome.e2e - outcome.ttft) / (outcome.output_tokens - 1))
        m.e2e.observe(outcome.e2e)
        m.generation_tokens.inc(outcome.output_tokens)
        verdict = self.tracker.record(outcome)
        if verdict is not None:  # a non-streamed answer is not judged against the token objectives
            self._slo_outcomes[(outcome.priority, "ttft", verdict.ttft)].inc()
            self._slo_outcomes[(outcome.priority, "itl", verdict.itl)].inc()
        self.latency.record(outcome)

    def _refresh_attainment(self, now: float) -> None:
        for p in PriorityClass:
            att = self.tracker.attainment(p, now=now)
            for objective in ("ttft", "itl", "all"):
                value = 1.0 if att is None else getattr(att, objective)
                self.slo_attainment.labels(p.value, objective).set(value)

    def render(self) -> bytes:
        self._refresh_attainment(time.perf_counter())
        return generate_latest(self.registry)
