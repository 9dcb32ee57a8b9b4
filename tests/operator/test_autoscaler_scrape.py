"""Scraping a pod's proxy /metrics: the real proxy's body parses; hostile bodies and broken pods become
failed pods, never exceptions. Fetches go to real loopback servers."""

from __future__ import annotations

import asyncio
import math
import socket
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from decodeservice.operator.autoscaler.scrape import (
    PodTarget,
    ScrapeError,
    ScrapeSettings,
    census,
    parse_metrics,
    scrape,
)
from decodeservice.proxy.metrics import ProxyMetrics
from decodeservice.proxy.policy import Policy, PriorityClass
from decodeservice.proxy.slo import RequestOutcome
from tests.support.loopback_http import serve

GOOD = """\
# TYPE decode_proxy:time_to_first_token_seconds histogram
decode_proxy:time_to_first_token_seconds_bucket{class="interactive",le="0.1"} 3
decode_proxy:time_to_first_token_seconds_bucket{class="interactive",le="1.0"} 9
decode_proxy:time_to_first_token_seconds_bucket{class="interactive",le="+Inf"} 10
decode_proxy:time_to_first_token_seconds_count{class="interactive"} 10
decode_proxy:time_to_first_token_seconds_sum{class="interactive"} 4.2
# TYPE decode_proxy:num_requests_waiting gauge
decode_proxy:num_requests_waiting{class="interactive"} 2
decode_proxy:num_requests_waiting{class="batch"} 5
# TYPE decode_proxy:num_requests_running gauge
decode_proxy:num_requests_running 7
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="m"} 0.25
vllm:num_requests_waiting{model_name="m"} 1
vllm:num_requests_running{model_name="m"} 6
"""


def test_a_real_proxy_body_parses_into_the_recorded_values() -> None:
    metrics = ProxyMetrics(Policy())
    for ttft in (0.05, 0.3, 3.0):
        metrics.record(RequestOutcome(priority=PriorityClass.INTERACTIVE, finished=time.perf_counter(), ttft=ttft,
                                      upstream_ttft=ttft, service_time=1.0, e2e=ttft + 1.0, itls=(0.02, 0.2),
                                      output_tokens=3))
    metrics.running.set(4)
    metrics.for_class[PriorityClass.BATCH].waiting.set(3)
    sample = parse_metrics(metrics.render().decode(), pod="p", at=1.5)
    assert (sample.pod, sample.at, sample.inflight) == ("p", 1.5, 4.0)
    assert set(sample.classes) == {"interactive", "batch"}
    inter = sample.classes["interactive"]
    assert inter.ttft is not None and inter.itl is not None
    assert inter.ttft.total == 3 and inter.ttft.counts[-1] == 3 and inter.ttft.bounds[-1] == math.inf
    assert inter.ttft.counts[inter.ttft.bounds.index(0.1)] == 1  # only the 50 ms one is under 100 ms
    assert inter.itl.total == 6
    assert sample.classes["batch"].queue_depth == 3 and sample.classes["batch"].ttft is not None
    assert sample.kv_cache_usage is None and sample.engine_waiting is None  # no engine relayed here


def test_engine_series_and_queue_depths() -> None:
    sample = parse_metrics(GOOD, pod="p", at=0.0)
    assert (sample.kv_cache_usage, sample.engine_waiting, sample.engine_running) == (0.25, 1.0, 6.0)
    assert sample.classes["interactive"].queue_depth == 2 and sample.classes["batch"].queue_depth == 5
    assert sample.classes["batch"].ttft is None and sample.classes["interactive"].itl is None
    ttft = sample.classes["interactive"].ttft
    assert ttft is not None and ttft.bounds == (0.1, 1.0, math.inf) and ttft.counts == (3, 9, 10)


def test_sheds_for_want_of_capacity_are_counted_per_class_and_a_tenants_rate_limit_is_not() -> None:
    metrics = ProxyMetrics(Policy())  # the real proxy's counter, as it renders it
    metrics.shed.labels("interactive", "queue_full").inc(4)
    metrics.shed.labels("interactive", "slo").inc(2)
    metrics.shed.labels("interactive", "tenant_rate").inc(50)  # policy, not demand the fleet failed
    metrics.shed.labels("batch", "tenant_rate").inc(7)
    sample = parse_metrics(metrics.render().decode(), pod="p", at=0.0)
    assert sample.classes["interactive"].shed == 6
    assert "batch" not in sample.classes or sample.classes["batch"].shed == 0
    with pytest.raises(ScrapeError, match="finite"):
        parse_metrics(GOOD + 'decode_proxy:requests_shed_total{class="batch",reason="slo"} -1\n', pod="p", at=0.0)


@pytest.mark.parametrize(("body", "why"), [
    ("\x00\x01\xff garbage {{{", "unparseable"),
    ("decode_proxy:num_requests_running NaN\n", "finite"),
    ("decode_proxy:num_requests_running -3\n", "finite"),
    ("decode_proxy:num_requests_running +Inf\n", "finite"),
    ("# only comments\n", "not a DecodeService proxy"),
    ("decode_proxy:num_requests_waiting{class=\"interactive\"} 1\n", "not a DecodeService proxy"),
    (GOOD.replace('le="+Inf"} 10', 'le="+Inf"} 2'), "decrease"),
    (GOOD.replace('{class="interactive",le="+Inf"} 10\n', '{class="interactive",le="5"} 10\n'), "+Inf"),
    (GOOD.replace('le="1.0"', 'le="soon"'), "not a number"),
    (GOOD.replace("0.25", "7"), "outside [0, 1]"),
    (GOOD + "".join(f'decode_proxy:num_requests_waiting{{class="c{i}"}} 1\n' for i in range(40)), "classes"),
    (GOOD + "".join(f'decode_proxy:time_to_first_token_seconds_bucket{{class="batch",le="{i}"}} {i}\n'
                    for i in range(100)), "buckets"),
])
def test_hostile_bodies_are_refused_with_a_reason(body: str, why: str) -> None:
    with pytest.raises(ScrapeError) as info:
        parse_metrics(body, pod="p", at=0.0)
    assert why in str(info.value)


def test_a_kv_gauge_name_no_supported_vllm_has_is_not_read() -> None:
    body = GOOD.replace("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # vLLM before 0.10
    body += 'vllm:num_requests_waiting{model_name="m",engine="1"} 2\n'
    sample = parse_metrics(body, pod="p", at=0.0)
    assert (sample.kv_cache_usage, sample.engine_waiting) == (None, 3.0)


def test_unused_series_may_hold_anything() -> None:
    sample = parse_metrics(GOOD + "vllm:something_else NaN\ndecode_proxy:requests_total -1\n", pod="p", at=0.0)
    assert sample.inflight == 7


def _pod(name: str, *, ready: bool, ip: str | None = "10.0.0.1", **meta: Any) -> dict[str, Any]:
    status: dict[str, Any] = {"phase": "Running", "conditions": [{"type": "Ready", "status": str(ready)}]}
    if ip:
        status["podIP"] = ip
    return {"metadata": {"name": name, **meta}, "status": status}


def test_census_counts_ready_starting_and_skips_terminating() -> None:
    pods = [_pod("b", ready=True), _pod("a", ready=True, ip="fd00::1"), _pod("c", ready=False),
            _pod("d", ready=True, ip=None), _pod("e", ready=True, deletionTimestamp="2026-01-01T00:00:00Z"),
            {"metadata": {"name": "f"}, "status": {"phase": "Failed"}}, {"metadata": {"name": "g"}}]
    got = census(pods, overrides={"b": "http://127.0.0.1:9/"})
    assert got.ready == (PodTarget(pod="a", url="http://[fd00::1]:8000"), PodTarget(pod="b", url="http://127.0.0.1:9"))
    assert got.starting == 3  # c (not ready), d (no IP yet), g (no status yet)


@pytest.fixture
async def pods() -> AsyncIterator[dict[str, str]]:
    never = asyncio.Event()

    async def good(_: web.Request) -> web.Response:
        return web.Response(text=GOOD)

    async def huge(_: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(_)
        for _i in range(64):  # 4 MiB of valid-looking lines, past the 1 MiB cap
            await resp.write(b"decode_proxy:num_requests_running 1\n" * 2000)
        return resp

    async def binary(_: web.Request) -> web.Response:
        return web.Response(body=bytes(range(256)) * 16)

    async def error(_: web.Request) -> web.Response:
        return web.Response(status=500, text="boom")

    async def slow(_: web.Request) -> web.Response:
        await never.wait()  # answers only when the test ends
        return web.Response(text=GOOD)

    urls: dict[str, str] = {}
    async with AsyncExitStack() as servers:
        for name, handler in (("good", good), ("huge", huge), ("binary", binary), ("error", error), ("slow", slow)):
            app = web.Application()
            app.router.add_get("/metrics", handler)
            urls[name] = await servers.enter_async_context(serve(app))
        with socket.socket() as s:  # a port nobody listens on: connection refused
            s.bind(("127.0.0.1", 0))
            urls["refused"] = f"http://127.0.0.1:{s.getsockname()[1]}"
        try:
            yield urls
        finally:
            never.set()


async def test_scrape_keeps_good_pods_and_lists_every_broken_one(pods: dict[str, str]) -> None:
    targets = [PodTarget(pod=name, url=url) for name, url in pods.items()]
    settings = ScrapeSettings(timeout_seconds=0.5)
    async with aiohttp.ClientSession() as session:
        result = await scrape(session, targets, settings=settings, clock=lambda: 42.0)
    assert [s.pod for s in result.samples] == ["good"]
    assert result.samples[0].at == 42.0 and result.samples[0].inflight == 7
    assert set(result.failed) == {"huge", "binary", "error", "slow", "refused"}
    assert "over 1048576 bytes" in result.errors["huge"]
    assert "HTTP 500" in result.errors["error"]
    assert "no answer within 0.5s" in result.errors["slow"]
    assert "not UTF-8" in result.errors["binary"] or "unparseable" in result.errors["binary"]


def test_scrape_settings_check_themselves() -> None:
    with pytest.raises(ValueError, match="must be > 0"):
        ScrapeSettings(timeout_seconds=0)
