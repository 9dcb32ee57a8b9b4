"""The router's Prometheus metrics, `decode_router:*`, each documented in router/METRICS.md.

The names are a contract with the operator (its autoscaler reads `requests_held` and
`last_request_timestamp_seconds`) and the dashboards: change none without changing both.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from decodeservice.proxy.metrics import TTFT_BUCKETS
from decodeservice.proxy.policy import PriorityClass

PREFIX = "decode_router:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
SHED_REASONS = ("slo", "hold_timeout", "hold_full")
DECISION_REASONS = ("prefix_hit_within_slo", "least_predicted_ttft", "least_work", "rendezvous",
                    "only_endpoint")


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        cls = ["class"]
        self.requests = Counter(f"{PREFIX}requests", "Completion requests answered, by class and HTTP status "
                                "(499: the client left).", ["class", "status"], registry=r)
        self.held = Gauge(f"{PREFIX}requests_held", "Requests held right now waiting for a ready endpoint.",
                          cls, registry=r)
        self.shed = Counter(f"{PREFIX}requests_shed", "Requests refused at the edge, by class and reason "
                            "(slo: 429; hold_timeout, hold_full: 503).", ["class", "reason"], registry=r)
        self.last_request = Gauge(f"{PREFIX}last_request_timestamp_seconds",
                                  "Unix time of the last completion request received (0 before any).", registry=r)
        self.endpoints = Gauge(f"{PREFIX}endpoints", "Endpoints by state (ready, known).", ["state"], registry=r)
        self.decisions = Counter(f"{PREFIX}decisions", "Routing decisions, by endpoint and reason.",
                                 ["endpoint", "reason"], registry=r)
        self.predicted_ttft = Histogram(f"{PREFIX}predicted_ttft_seconds",
                                        "TTFT predicted for the chosen endpoint at dispatch.", cls,
                                        buckets=TTFT_BUCKETS, registry=r)
        self.ttft = Histogram(f"{PREFIX}time_to_first_token_seconds",
                              "Arrival at the router to the first token event (streamed requests).", cls,
                              buckets=TTFT_BUCKETS, registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}prompt_tokens", "Prompt tokens routed (the engine's usage count "
                                     "when it reports one, else the router's estimate).", registry=r)
        self.prefix_predicted = Counter(f"{PREFIX}prefix_tokens_predicted",
                                        "Prompt tokens the router expected cached on the chosen endpoint.",
                                        registry=r)
        self.prefix_cached = Counter(f"{PREFIX}prefix_tokens_cached", "Prompt tokens the engine reported "
                                     "served from its prefix cache (usage.prompt_tokens_details.cached_tokens).",
                                     registry=r)
        for p in PriorityClass:
            self.held.labels(p.value).set(0)
            for reason in SHED_REASONS:
                self.shed.labels(p.value, reason)
        self.last_request.set(0)
        for state in ("ready", "known"):
            self.endpoints.labels(state).set(0)

    def render(self, *, ready: int, known: int) -> bytes:
        self.endpoints.labels("ready").set(ready)
        self.endpoints.labels("known").set(known)
        return generate_latest(self.registry)
