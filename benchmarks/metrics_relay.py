"""What relaying the engine's vllm:* series costs a proxy /metrics scrape (proxy/engine_metrics.py).

Three peers, side by side in one run, all served by uvicorn on loopback in this process:

- `engine`: the engine's own /metrics (`ServerMetrics`, the builtin engine's exposition), fetched directly;
- `proxy_own`: the proxy's own series only (`ProxyMetrics.render()`, what /metrics served before the relay);
- `proxy_relay`: the real proxy app (`create_app`) in front of that engine: its series plus the relayed ones.

First, CPU per call (process time, so a busy machine does not inflate it): rendering the proxy's own
series, rendering the engine's, and the relay's parse + re-render of one engine body (paid once per
upstream fetch, not per scrape). Then two loads per peer: an open loop at `--rate` scrapes/s (default 20: the operator's autoscaler plus
Prometheus and a few dashboards is far less), reporting scrape latency; and a closed loop of
`--concurrency` scrapers as fast as they go, reporting scrapes/s. For `proxy_relay` it also reports the
upstream fetches per scrape (the 50 ms cache and the shared in-flight fetch keep it well under 1).

    python -P benchmarks/metrics_relay.py --seconds 5 --out benchmarks/results/metrics_relay.json

JSON goes to stdout (and to `--out FILE`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from decodeservice.engine.outputs import EngineStats
from decodeservice.engine.server.metrics import ServerMetrics
from decodeservice.proxy.app import create_app
from decodeservice.proxy.engine_metrics import relay_text
from decodeservice.proxy.metrics import CONTENT_TYPE, ProxyMetrics
from decodeservice.proxy.policy import Policy

# The repo root, for tests.support (the loopback server helper lives with the tests, outside the wheel).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.support.fake_engine import serve_loopback

STATS = EngineStats(num_running=12, num_waiting=3, kv_cache_usage=0.42, num_blocks=1000, num_free_blocks=580,
                    prefix_cache_queries=10_000, prefix_cache_hits=4_000, num_preemptions=2, prompt_tokens=50_000,
                    generation_tokens=80_000)


class Counter:
    fetches = 0


def engine_app(counter: Counter) -> Starlette:
    metrics = ServerMetrics(model_name="smollm2", stats=lambda: STATS)
    for i in range(200):  # histograms with data, as a busy engine's are
        metrics.ttft.observe(0.01 * (i % 50))
        metrics.itl.observe(0.001 * (i % 80))

    async def scrape(_: Request) -> Response:
        counter.fetches += 1
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    async def ready(_: Request) -> Response:
        return JSONResponse({"ready": True})

    return Starlette(routes=[Route("/metrics", scrape), Route("/ready", ready)])


def own_only_app() -> Starlette:
    metrics = ProxyMetrics(Policy())

    async def scrape(_: Request) -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return Starlette(routes=[Route("/metrics", scrape)])


def _summary(latencies: list[float]) -> dict[str, float]:
    ordered = sorted(latencies)
    return {"p50_ms": round(statistics.median(ordered) * 1000, 3),
            "p99_ms": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000, 3),
            "mean_ms": round(statistics.fmean(ordered) * 1000, 3)}


async def open_loop(client: httpx.AsyncClient, url: str, *, rate: float, seconds: float) -> dict[str, Any]:
    latencies: list[float] = []

    async def one() -> None:
        start = time.perf_counter()
        response = await client.get(url)
        assert response.status_code == 200
        latencies.append(time.perf_counter() - start)

    tasks = []
    begin = time.perf_counter()
    for i in range(int(rate * seconds)):
        await asyncio.sleep(max(0.0, begin + i / rate - time.perf_counter()))
        tasks.append(asyncio.create_task(one()))
    await asyncio.gather(*tasks)
    return {"scrapes": len(latencies), **_summary(latencies)}


async def closed_loop(client: httpx.AsyncClient, url: str, *, concurrency: int, seconds: float) -> dict[str, Any]:
    done = 0
    deadline = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            response = await client.get(url)
            assert response.status_code == 200
            done += 1

    begin = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return {"scrapes": done, "scrapes_per_s": round(done / (time.perf_counter() - begin), 1)}


def cpu_ms(fn: Any, *, n: int) -> float:
    """CPU milliseconds per call (process time: what the call costs, not how long a busy machine waited)."""
    fn()
    start = time.process_time()
    for _ in range(n):
        fn()
    return round((time.process_time() - start) / n * 1000, 4)


def render_costs() -> dict[str, float]:
    metrics = ServerMetrics(model_name="smollm2", stats=lambda: STATS)
    for i in range(200):
        metrics.ttft.observe(0.01 * (i % 50))
    upstream = metrics.render().decode()
    own = ProxyMetrics(Policy())
    return {"proxy_own_render_cpu_ms": cpu_ms(own.render, n=300),
            "engine_render_cpu_ms": cpu_ms(metrics.render, n=300),
            "relay_parse_and_render_cpu_ms_per_fetch": cpu_ms(lambda: relay_text(upstream), n=300)}


async def main(args: argparse.Namespace) -> dict[str, Any]:
    counter = Counter()
    results: dict[str, Any] = {"rate": args.rate, "concurrency": args.concurrency, "seconds": args.seconds,
                               "cpu": render_costs(), "peers": {}}
    async with serve_loopback(engine_app(counter)) as engine_url, \
            serve_loopback(own_only_app()) as own_url, \
            serve_loopback(create_app(Policy(), engine_url)) as relay_url, \
            httpx.AsyncClient(timeout=10.0, limits=httpx.Limits(max_connections=args.concurrency * 2)) as client:
        body = (await client.get(f"{relay_url}/metrics")).text
        results["relay_body_bytes"] = len(body.encode())
        results["relayed_vllm_lines"] = sum(1 for line in body.splitlines() if line.startswith("vllm:"))
        for peer, base in (("engine", engine_url), ("proxy_own", own_url), ("proxy_relay", relay_url)):
            url = f"{base}/metrics"
            before = counter.fetches
            opened = await open_loop(client, url, rate=args.rate, seconds=args.seconds)
            mid = counter.fetches
            closed = await closed_loop(client, url, concurrency=args.concurrency, seconds=args.seconds)
            entry: dict[str, Any] = {"open_loop": opened, "closed_loop": closed}
            if peer == "proxy_relay":
                opened["upstream_fetches_per_scrape"] = round((mid - before) / opened["scrapes"], 3)
                closed["upstream_fetches_per_scrape"] = round((counter.fetches - mid) / closed["scrapes"], 3)
            results["peers"][peer] = entry
    p = results["peers"]
    relay, own = p["proxy_relay"], p["proxy_own"]
    results["ratios"] = {
        "relay_vs_own_p50_open_loop": round(relay["open_loop"]["p50_ms"] / own["open_loop"]["p50_ms"], 2),
        "relay_vs_own_throughput_closed_loop": round(relay["closed_loop"]["scrapes_per_s"]
                                                     / own["closed_loop"]["scrapes_per_s"], 2),
    }
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=20.0, help="open-loop scrapes per second (default 20)")
    parser.add_argument("--concurrency", type=int, default=8, help="closed-loop scrapers (default 8)")
    parser.add_argument("--seconds", type=float, default=5.0, help="per peer and load (default 5)")
    parser.add_argument("--out", type=Path, default=None)
    parsed = parser.parse_args()
    text = json.dumps(asyncio.run(main(parsed)), indent=2)
    print(text)
    if parsed.out is not None:
        parsed.out.write_text(text + "\n")
