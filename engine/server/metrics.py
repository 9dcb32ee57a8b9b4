"""Prometheus metrics under vLLM's names, so dashboards, KEDA triggers and the Gateway API Inference
Extension built for vLLM read us unchanged.

Engine-wide gauges and counters come from one `EngineStats` snapshot per scrape (a custom collector),
so they are mutually consistent. Per-request histograms and `request_success` are observed by the
HTTP layer as each request streams. Every series carries `model_name`, as vLLM's do.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from decodeservice.engine.outputs import EngineStats, RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's bucket boundaries, so histogram_quantile queries written for vLLM mean the same here.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)

_EMPTY_STATS = EngineStats(num_running=0, num_waiting=0, kv_cache_usage=0.0, num_blocks=0, num_free_blocks=0,
                           prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0, prompt_tokens=0,
                           generation_tokens=0)


class _EngineStatsCollector(Collector):
    """Reads the engine's counters at scrape time; zeros while the model is still loading."""

    def __init__(self, model_name: str, stats: Callable[[], EngineStats | None]) -> None:
        self._model_name = model_name
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats() or _EMPTY_STATS
        label = [self._model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(label, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(label, value)
            return family

        yield gauge("vllm:num_requests_running", "Requests in the running batch.", s.num_running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent.", s.kv_cache_usage)
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      s.prefix_cache_queries)
        yield counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits)
        yield counter("vllm:num_preemptions", "Preemptions of running requests.", s.num_preemptions)
        yield counter("vllm:prompt_tokens", "Prefill tokens processed.", s.prompt_tokens)
        yield counter("vllm:generation_tokens", "Generation tokens produced.", s.generation_tokens)
        spec = s.spec_decode
        yield counter("vllm:spec_decode_num_drafts", "Speculative drafts verified.", spec.num_drafts)
        yield counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.", spec.num_draft_tokens)
        yield counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", spec.num_accepted_tokens)
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, by position in the draft.",
                                      labels=["model_name", "position"])
        for position, accepted in enumerate(spec.accepted_per_position):
            per_pos.add_metric([self._model_name, str(position)], accepted)
        yield per_pos


class ServerMetrics:
    """One registry per server (no process-global state), with the per-request families."""

    def __init__(self, *, model_name: str, stats: Callable[[], EngineStats | None]) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(_EngineStatsCollector(model_name, stats))
        labels = ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", labels,
                              buckets=TTFT_BUCKETS, registry=self.registry).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between streamed token batches.", labels,
                             buckets=ITL_BUCKETS, registry=self.registry).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request latency, arrival to last token.",
                             labels, buckets=REQUEST_BUCKETS, registry=self.registry).labels(model_name)
        self.queue = Histogram("vllm:request_queue_time_seconds", "Time spent waiting before first scheduled.",
                               labels, buckets=REQUEST_BUCKETS, registry=self.registry).labels(model_name)
        self._success = Counter("vllm:request_success", "Finished requests, by finish reason.",
                                ["model_name", "finished_reason"], registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def tracker(self) -> RequestTracker:
        return RequestTracker(self)

    def count_finished(self, reason: str) -> None:
        self._success.labels(self.model_name, reason).inc()


class RequestTracker:
    """Observes one request's latencies as its outputs arrive (server clock: what the client sees)."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics
        self.start = time.monotonic()
        self._last_token: float | None = None
        self._done = False

    def observe(self, out: RequestOutput) -> None:
        now = time.monotonic()
        if out.new_token_ids:
            if self._last_token is None:
                self._metrics.ttft.observe(now - self.start)
            else:
                self._metrics.itl.observe(now - self._last_token)
            self._last_token = now
        if out.finished and not self._done:
            self._done = True
            self._metrics.e2e.observe(now - self.start)
            m = out.metrics
            if m.first_scheduled_time is not None:
                self._metrics.queue.observe(max(m.first_scheduled_time - m.arrival_time, 0.0))
            self._metrics.count_finished(out.finish_reason or "stop")

    def aborted(self) -> None:
        """The client left, or the engine failed, before the request finished."""
        if not self._done:
            self._done = True
            self._metrics.count_finished("abort")
