"""Proxy overhead and batching-window sweep.

Overhead mode (default): serves the fake engine (`tests/support/fake_engine.py`) with uvicorn in the
load generator's own event loop and starts `decodectl proxy` as a subprocess, both on loopback, then
runs `--concurrency` concurrent streams directly against the engine and through the proxy, alternating
for `--rounds` paired rounds. Reports the added p50 TTFT (target < 1 ms), also as the median and
quartiles of the per-round differences, and the output tokens/s lost (target < 2 %). With at least 2
usable CPUs (or `--pin`), the load generator and the engine share one core and the proxy gets another,
in the direct and the proxied run alike: the proxy is a sidecar with its own CPU in production. Each
process's CPU seconds per 1000 output tokens (from /proc) is reported too; the proxy's is its
machine-independent cost. The load generator's garbage collector is off during a round (its pauses
moved a round's p50 by tens of ms); the proxy's is left alone.

Sweep mode (`--engine-url URL`): for each batching window (default 0, 5, 20, 50 ms) starts a proxy in
front of that engine with the window on the `batch` class, sends `batch` streams, and reports throughput
and TTFT per window. By default the streams come as a closed loop at `--concurrency`; `--rate R` sends
them as seeded Poisson arrivals instead (open loop), where a window has separate arrivals to group.

    python benchmarks/proxy_overhead.py --out overhead.json
    python benchmarks/proxy_overhead.py --engine-url http://127.0.0.1:8001 --out sweep.json
    python benchmarks/proxy_overhead.py --engine-url http://127.0.0.1:8001 --rate 2 --requests 48

JSON goes to stdout (and to `--out FILE`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import importlib.util
import os
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import uvloop

from decodeservice.common.stats import percentile
from decodeservice.loadgen.client import BenchRequest
from decodeservice.loadgen.load import LoadLevel, Sender, run_level
from decodeservice.loadgen.metrics import RequestRecord
from decodeservice.loadgen.procs import ChildServer, decodectl, free_port
from decodeservice.proxy.streaming import SseMeter
from decodeservice.proxy.transport import UpstreamTransport

# The fake engine is test support, outside the installed packages: this study runs from a checkout.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.support.fake_engine import FakeEngine, serve_loopback

sys.path.insert(0, str(Path(__file__).parent))  # `python -P` leaves the script's folder off the path
from json_out import emit

_CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a whole process (all its threads), from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        # The command name (field 2) may hold spaces; utime and stime are fields 14 and 15.
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


@contextlib.contextmanager
def _spawned_on(cpus: set[int] | None) -> Iterator[None]:
    """Children started inside inherit `cpus` at fork, before they create any thread."""
    if cpus is None:
        yield
        return
    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, mine)


@contextlib.asynccontextmanager
async def proxy(upstream: str, policy_yaml: str, *, logs: Path, cpus: set[int] | None = None,
                ) -> AsyncIterator[ChildServer]:
    """`decodectl proxy` as a subprocess on `cpus`, ready (GET /health) when entered."""
    port = free_port()
    policy = logs / f"policy-{port}.yaml"
    policy.write_text(policy_yaml)
    argv = decodectl("proxy", "--upstream", upstream, "--port", str(port), "--policy", str(policy),
                     "--log-level", "warning")
    child = ChildServer(name="proxy", argv=argv, url=f"http://127.0.0.1:{port}", log_path=logs / "proxy.log")
    try:
        with _spawned_on(cpus):
            child.start()
        await child.wait_ready(timeout_s=60.0, path="/health")
        yield child
    finally:
        child.stop()


def metered_sender(url: str, body: dict[str, Any], headers: dict[str, str]) -> Sender:
    """Posts `body` as it is and times the token events with a byte scan, not a JSON parse per chunk.

    The load generator shares a core with the engine, so its per-chunk work must stay small (the
    default `send` parses every chunk). The scan is the proxy's own (tests/proxy/test_streaming.py).
    """
    async def send_metered(client: httpx.AsyncClient, request: BenchRequest) -> RequestRecord:
        start = time.perf_counter()
        meter = SseMeter()
        async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                await r.aread()
                return RequestRecord(start=start, end=time.perf_counter(), error=f"HTTP {r.status_code}")
            async for chunk in r.aiter_raw():
                meter.feed(chunk, time.perf_counter())
        times = tuple(meter.token_times)
        return RequestRecord(start=start, end=time.perf_counter(), chunk_times=times, output_tokens=len(times))

    return send_metered


def load_client(concurrency: int) -> httpx.AsyncClient:
    """The load generator's client. It shares a core with the engine, so it must be light.

    httpx's default transport spends more CPU per chunk than the fake engine does, so the benchmark
    would mostly measure its own client; the proxy's transport is used instead, on both sides alike.
    """
    return httpx.AsyncClient(timeout=httpx.Timeout(300.0),
                             transport=UpstreamTransport(max_idle_per_origin=concurrency + 8))


async def run_load(url: str, *, level: LoadLevel, requests: int, body: dict[str, Any],
                   headers: dict[str, str] | None = None, client: httpx.AsyncClient | None = None,
                   seed: int = 0) -> dict[str, Any]:
    """`requests` streams at `level` (closed loop or Poisson, `bench.load.run_level`); TTFT percentiles
    and output tokens/s.

    With `client`, its kept-alive connections are reused; otherwise a fresh client connects anew.
    """
    planned = [BenchRequest(id=str(i), prompt=str(body["prompt"]), max_tokens=int(body["max_tokens"]))
               for i in range(requests)]
    async with contextlib.AsyncExitStack() as stack:
        if client is None:
            client = await stack.enter_async_context(load_client(requests))
        start = time.perf_counter()
        records = await run_level(url=url, model=str(body["model"]), requests=planned, level=level, seed=seed,
                                  client=client, sender=metered_sender(url, body, headers or {}))
        wall = time.perf_counter() - start
    ttfts = [r.ttft for r in records if r.ttft is not None]
    e2e = [r.e2e for r in records if r.error is None]
    tokens = sum(r.output_tokens for r in records)
    result = {
        "requests": requests, "ok": sum(1 for r in records if r.error is None), "wall_s": wall,
        "output_tokens": tokens, "output_tokens_per_s": tokens / wall,
        "ttft_p50_ms": percentile(ttfts, 50) * 1000 if ttfts else None,
        "ttft_p95_ms": percentile(ttfts, 95) * 1000 if ttfts else None,
    }
    if level.kind == "rate":
        result["e2e_p50_ms"] = percentile(e2e, 50) * 1000 if e2e else None
    return result


def closed_loop(concurrency: int) -> LoadLevel:
    return LoadLevel(kind="concurrency", value=concurrency)


OVERHEAD_POLICY = """\
admission: {maxInflight: 256}
classes:
  interactive: {batchWindowMs: 0, maxBatch: 1, maxQueue: 1024}
"""


def _pinning(requested: bool | None) -> tuple[set[int], set[int]] | None:
    """(client + engine CPUs, proxy CPUs), or None to leave placement to the OS scheduler.

    In production the proxy is a sidecar with its own CPU. Pinning gives the client and the engine the
    same single core in the direct and the proxied run, so the proxy's own CPU cannot slow them down
    and the comparison measures the added latency, not the contention of a shared core.
    """
    cpus = sorted(os.sched_getaffinity(0))
    if requested is False or (requested is None and len(cpus) < 2):
        return None
    if len(cpus) < 2:
        raise SystemExit("--pin needs at least 2 usable CPUs")
    return {cpus[0]}, {cpus[1]}


async def _measured(url: str, pids: dict[str, int], **load: Any) -> dict[str, Any]:
    """One load run, plus the CPU seconds each process spent during it."""
    # The load generator's own garbage collections would land inside some rounds and not others.
    gc.collect()
    gc.disable()
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    try:
        result = await run_load(url, **load)
    finally:
        gc.enable()
    result["cpu_s"] = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
    return result


async def _alternate(engine_url: str, proxy_url: str, pids: dict[str, int], rounds: int, **load: Any,
                     ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Direct and proxied rounds, alternating so machine noise hits both sides alike.

    Each side keeps one client whose connections stay open across rounds, as an SDK's would: with a
    fresh client per round the proxied run would move the engine's connection set-up onto the
    proxy's core and flatter the proxy.
    """
    direct: list[dict[str, Any]] = []
    proxied: list[dict[str, Any]] = []
    width = int(load["level"].value)
    async with load_client(width) as to_engine, load_client(width) as to_proxy:
        await run_load(proxy_url, client=to_proxy, **load)  # warm-up: connections, imports
        await run_load(engine_url, client=to_engine, **load)
        for _ in range(rounds):
            direct.append(await _measured(engine_url, pids, client=to_engine, **load))
            proxied.append(await _measured(proxy_url, pids, client=to_proxy, **load))
    return direct, proxied


def _cpu_per_1k(rows: list[dict[str, Any]]) -> dict[str, float]:
    """CPU seconds per 1000 output tokens, over all rounds together (the /proc tick is 10 ms)."""
    tokens = sum(r["output_tokens"] for r in rows)
    return {name: 1000.0 * sum(r["cpu_s"][name] for r in rows) / tokens for name in rows[0]["cpu_s"]}


async def _overhead_rounds(args: argparse.Namespace, load: dict[str, Any], pins: tuple[set[int], set[int]] | None,
                           logs: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    # The fake engine is served by uvicorn in this very loop. As two processes sharing one core, the
    # client and the engine were interleaved by the OS scheduler differently every round, and a
    # round's p50 TTFT moved by +-10 ms: ten times the effect to be measured. In one loop the order
    # of work is the same in every round, direct and proxied alike.
    engine = FakeEngine(ttft_s=args.ttft_ms / 1000.0, itl_s=args.itl_ms / 1000.0, default_tokens=args.tokens)
    async with serve_loopback(engine.app()) as engine_url:
        engine.url = engine_url
        async with proxy(engine_url, OVERHEAD_POLICY, logs=logs, cpus=None if pins is None else pins[1]) as prox:
            assert prox.pid is not None
            pids = {"client_and_engine": os.getpid(), "proxy": prox.pid}
            return await _alternate(engine_url, prox.url, pids, args.rounds, **load)


def overhead(args: argparse.Namespace) -> dict[str, Any]:
    body = {"model": "fake-model", "prompt": "hello", "max_tokens": args.tokens, "stream": True}
    n = args.concurrency
    load = {"level": closed_loop(n), "requests": n, "body": body}
    pins = _pinning(args.pin)
    with tempfile.TemporaryDirectory() as tmp:
        if pins is not None:
            os.sched_setaffinity(0, pins[0])  # before the loop starts: uvicorn's threads inherit it
            # the proxy child is started with the other CPU (see _spawned_on)
        direct, proxied = uvloop.run(_overhead_rounds(args, load, pins, Path(tmp)))

    def med(rows: list[dict[str, Any]], key: str) -> float:
        return percentile([float(r[key]) for r in rows], 50)

    d_ttft, p_ttft = med(direct, "ttft_p50_ms"), med(proxied, "ttft_p50_ms")
    d_tps, p_tps = med(direct, "output_tokens_per_s"), med(proxied, "output_tokens_per_s")
    paired = [p["ttft_p50_ms"] - d["ttft_p50_ms"] for d, p in zip(direct, proxied, strict=True)]
    busy = sum(r["cpu_s"]["client_and_engine"] for r in direct) / sum(r["wall_s"] for r in direct)
    return {
        "mode": "overhead",
        "config": {"concurrency": n, "tokens": args.tokens, "ttft_ms": args.ttft_ms, "itl_ms": args.itl_ms,
                   "rounds": args.rounds, "engine": "fake engine in the load generator's loop (uvloop)",
                   "uvloop": True, "httptools": importlib.util.find_spec("httptools") is not None},
        "pinning": None if pins is None else {"client_and_engine_cpus": sorted(pins[0]),
                                              "proxy_cpus": sorted(pins[1])},
        "direct": {"ttft_p50_ms": d_ttft, "output_tokens_per_s": d_tps},
        "proxy": {"ttft_p50_ms": p_ttft, "output_tokens_per_s": p_tps},
        "added_ttft_p50_ms": p_ttft - d_ttft,
        # Each proxied round minus the direct round before it: its median and quartiles show the noise.
        "added_ttft_p50_ms_paired": {"median": percentile(paired, 50), "q1": percentile(paired, 25),
                                     "q3": percentile(paired, 75)},
        "throughput_loss_pct": 100.0 * (d_tps - p_tps) / d_tps,
        # Above ~0.8 the load generator itself queues requests, and TTFT measures that queue too.
        "load_generator_cpu_busy": busy,
        "cpu_s_per_1k_output_tokens": {"direct": _cpu_per_1k(direct), "proxy": _cpu_per_1k(proxied)},
        "targets": {"added_ttft_p50_ms": "< 1", "throughput_loss_pct": "< 2"},
        "rounds": {"direct": direct, "proxy": proxied},
    }


async def _sweep_window(args: argparse.Namespace, engine_url: str, policy: str, logs: Path, body: dict[str, Any],
                        headers: dict[str, str]) -> dict[str, Any]:
    level = LoadLevel(kind="rate", value=args.rate) if args.rate else closed_loop(args.concurrency)
    async with proxy(engine_url, policy, logs=logs) as prox:
        return await run_load(prox.url, level=level, requests=args.requests, body=body, headers=headers,
                              seed=args.seed)


def sweep(args: argparse.Namespace) -> dict[str, Any]:
    engine_url = args.engine_url.rstrip("/")
    model = args.model or httpx.get(engine_url + "/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "prompt": args.prompt, "max_tokens": args.tokens, "stream": True, "temperature": 0}
    rows = []
    for window in args.windows:
        policy = (f"admission: {{maxInflight: {max(64, args.concurrency)}}}\n"
                  f"classes:\n  batch: {{batchWindowMs: {window}, maxBatch: {args.max_batch}, maxQueue: 4096}}\n")
        headers = {"x-priority": "batch"}
        with tempfile.TemporaryDirectory() as tmp:
            result = asyncio.run(_sweep_window(args, engine_url, policy, Path(tmp), body, headers))
        rows.append({"batch_window_ms": window, **result})
    return {"mode": "window_sweep", "engine_url": engine_url, "model": model,
            "config": {"arrivals": f"poisson {args.rate}/s seed {args.seed}" if args.rate
                       else f"closed loop, concurrency {args.concurrency}",
                       "requests": args.requests, "tokens": args.tokens, "max_batch": args.max_batch},
            "windows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64, help="max_tokens per stream")
    parser.add_argument("--rounds", type=int, default=25,
                        help="overhead mode: paired rounds (a round's p50 TTFT still varies by a few ms)")
    parser.add_argument("--ttft-ms", type=float, default=20.0, help="overhead mode: fake engine TTFT")
    parser.add_argument("--itl-ms", type=float, default=10.0, help="overhead mode: fake engine ITL")
    parser.add_argument("--pin", action=argparse.BooleanOptionalAction, default=None,
                        help="overhead mode: pin client + engine to one CPU and the proxy to another "
                        "(default: on when at least 2 CPUs are usable)")
    parser.add_argument("--engine-url", help="sweep mode: a running engine (ours, vLLM, or the fake)")
    parser.add_argument("--windows", type=lambda s: [float(x) for x in s.split(",")], default=[0, 5, 20, 50],
                        help="sweep mode: batching windows in ms (default 0,5,20,50)")
    parser.add_argument("--max-batch", type=int, default=16, help="sweep mode: maxBatch of the batch class")
    parser.add_argument("--requests", type=int, default=128, help="sweep mode: requests per window")
    parser.add_argument("--model", help="sweep mode: model name (default: the first of GET /v1/models)")
    parser.add_argument("--prompt", default="Once upon a time", help="sweep mode: prompt text")
    parser.add_argument("--rate", type=float, help="sweep mode: open-loop Poisson arrivals per second "
                        "instead of a closed loop at --concurrency")
    parser.add_argument("--seed", type=int, default=0, help="sweep mode: seed of the Poisson arrivals")
    args = parser.parse_args(argv)
    if args.concurrency < 1 or args.tokens < 1 or args.rounds < 1:
        parser.error("--concurrency, --tokens and --rounds must be >= 1")
    report = sweep(args) if args.engine_url else overhead(args)
    emit(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
