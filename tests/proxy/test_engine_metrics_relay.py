"""The proxy relays the engine's vllm:* series on its own /metrics (for the operator's autoscaler).

The upstream is a loopback server rendering the engine's real metrics (`ServerMetrics`) from stats the
test controls, plus a non-vllm family that must not be relayed."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from decodeservice.engine.outputs import EngineStats
from decodeservice.engine.server.metrics import ServerMetrics
from decodeservice.operator.autoscaler.scrape import parse_metrics
from decodeservice.proxy.engine_metrics import EngineMetricsRelay
from tests.support.fake_engine import serve_loopback


@dataclass
class Upstream:
    url: str = ""
    fetches: int = 0
    body: str | None = None  # served instead of the real metrics when set
    status: int = 200
    stats: EngineStats = EngineStats(num_running=5, num_waiting=3, kv_cache_usage=0.37, num_blocks=100,
                                     num_free_blocks=63, prefix_cache_queries=0, prefix_cache_hits=0,
                                     num_preemptions=0, prompt_tokens=10, generation_tokens=20)


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    up = Upstream()
    engine_metrics = ServerMetrics(model_name="m", stats=lambda: up.stats)

    async def metrics(_: Request) -> Response:
        up.fetches += 1
        text = up.body if up.body is not None else (
            engine_metrics.render().decode() + "# TYPE fake_engine_requests_started gauge\n"
            "fake_engine_requests_started 4\n")
        return PlainTextResponse(text, status_code=up.status)

    async def ready(_: Request) -> Response:
        return JSONResponse({"ready": True})

    app = Starlette(routes=[Route("/metrics", metrics), Route("/ready", ready)])
    async with serve_loopback(app) as url:
        up.url = url
        yield up


def _families(text: str) -> dict[str, Any]:
    families = list(text_string_to_metric_families(text))
    names = [f.name for f in families]
    assert len(names) == len(set(names)), "a family name appears twice"
    return {f.name: f for f in families}


def _value(families: dict[str, Any], name: str) -> float:
    return float(families[name].samples[0].value)


async def test_the_proxy_serves_its_own_and_the_engines_series(upstream: Upstream, proxy: Any) -> None:
    async with proxy({}, upstream.url) as (_, client):
        response = await client.get("/metrics")
    assert response.status_code == 200
    families = _families(response.text)
    assert _value(families, "vllm:kv_cache_usage_perc") == pytest.approx(0.37)
    assert _value(families, "vllm:num_requests_waiting") == 3
    assert _value(families, "vllm:num_requests_running") == 5
    assert "vllm:time_to_first_token_seconds" in families and "vllm:generation_tokens" in families
    assert "decode_proxy:num_requests_running" in families and "decode_proxy:time_to_first_token_seconds" in families
    assert "fake_engine_requests_started" not in families  # only vllm: families are relayed
    assert all(n.startswith(("vllm:", "decode_proxy:")) for n in families)
    # What the operator's scraper reads from this very body.
    sample = parse_metrics(response.text, pod="p", at=0.0)
    assert sample.kv_cache_usage is not None and 0.0 <= sample.kv_cache_usage <= 1.0
    assert (sample.kv_cache_usage, sample.engine_waiting, sample.engine_running) == (pytest.approx(0.37), 3.0, 5.0)


@pytest.mark.parametrize("failure", ["refused", "status", "garbage", "binary"])
async def test_a_broken_upstream_leaves_the_proxys_own_series(upstream: Upstream, proxy: Any, failure: str) -> None:
    url = upstream.url
    if failure == "refused":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            url = f"http://127.0.0.1:{s.getsockname()[1]}"
    elif failure == "status":
        upstream.status = 500
    elif failure == "garbage":
        upstream.body = "vllm:kv_cache_usage_perc{{{ not prometheus\n"
    else:
        upstream.body = "\x00\x01\x02vllm:\n\xff\ufffe"
    async with proxy({}, url) as (_, client):
        response = await client.get("/metrics")
    assert response.status_code == 200
    families = _families(response.text)
    assert "decode_proxy:num_requests_running" in families
    assert not [n for n in families if n.startswith("vllm:")]


async def test_concurrent_scrapes_share_one_upstream_fetch(upstream: Upstream) -> None:
    async with httpx.AsyncClient() as client:
        relay = EngineMetricsRelay(client, upstream.url, max_age_seconds=60.0)
        bodies = await asyncio.gather(*(relay.render() for _ in range(20)))
        assert upstream.fetches == 1 and relay.fetches == 1
        assert len(set(bodies)) == 1 and b"vllm:kv_cache_usage_perc" in bodies[0]
        await relay.render()  # still fresh: served from the cache
        assert upstream.fetches == 1

        stale = EngineMetricsRelay(client, upstream.url, max_age_seconds=0.0)
        await stale.render()
        upstream.stats = EngineStats(num_running=0, num_waiting=9, kv_cache_usage=0.9, num_blocks=100,
                                     num_free_blocks=10, prefix_cache_queries=0, prefix_cache_hits=0,
                                     num_preemptions=0, prompt_tokens=10, generation_tokens=20)
        text = (await stale.render()).decode()  # past max_age: fetched again, new values
        assert upstream.fetches == 3
        assert _value(_families(text), "vllm:num_requests_waiting") == 9
