"""What the router reads from each endpoint: its /ready, and the load figures in its /metrics.

The endpoints are the pods' proxies: their /metrics carries the proxy's own `decode_proxy:*` series
and, relayed, the engine's `vllm:*` ones (proxy/METRICS.md). The router reads three of them.
"""

from __future__ import annotations

import dataclasses

import httpx
from prometheus_client.parser import text_string_to_metric_families

from decodeservice.proxy.policy import PriorityClass

WAITING = "decode_proxy:num_requests_waiting"
RUNNING = "decode_proxy:num_requests_running"
KV_USAGE = "vllm:kv_cache_usage_perc"
PROBE_TIMEOUT_S = 2.0


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ScrapedLoad:
    waiting: dict[PriorityClass, float]  # the proxy's admission queue, per class
    running: float  # requests the proxy has in flight to its engine
    kv_usage: float  # the engine's KV-cache usage, 0..1 (the largest series, when vLLM has several)


NO_LOAD = ScrapedLoad(waiting={p: 0.0 for p in PriorityClass}, running=0.0, kv_usage=0.0)


def parse_load(text: str) -> ScrapedLoad:
    """The load figures of a /metrics body; absent series read as 0 (an engine without the relay)."""
    waiting = {p: 0.0 for p in PriorityClass}
    running = kv = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == WAITING:
                cls = sample.labels.get("class", "")
                if cls in waiting:
                    waiting[PriorityClass(cls)] = sample.value
            elif sample.name == RUNNING:
                running = sample.value
            elif sample.name == KV_USAGE:
                kv = max(kv, sample.value)
    return ScrapedLoad(waiting=waiting, running=running, kv_usage=min(max(kv, 0.0), 1.0))


async def probe_ready(client: httpx.AsyncClient, url: str) -> bool:
    """The proxy's /ready is 200 only while its engine is ready and it is not draining."""
    try:
        response = await client.get(url + "/ready", timeout=PROBE_TIMEOUT_S)
        await response.aread()
    except httpx.HTTPError:
        return False
    return response.status_code == 200


async def scrape_load(client: httpx.AsyncClient, url: str) -> ScrapedLoad | None:
    try:
        response = await client.get(url + "/metrics", timeout=PROBE_TIMEOUT_S)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    try:
        return parse_load(response.text)
    except ValueError:  # a garbled body: keep the last figures rather than guess
        return None
