"""Router overhead: 64 streams straight to an engine, through `decodectl proxy`, and through `decodectl router`.

    .venv/bin/python -P benchmarks/routing_overhead.py --out benchmarks/results/routing_overhead_c64.json

The method is `benchmarks/proxy_overhead.py`'s, reused from it: the fake engine is served in the load
generator's own event loop, the router runs as a subprocess (`--endpoints` the engine; one endpoint,
so every request still has its prompt keyed, looked up in the index and scored, and its load
counted), and direct, proxied and routed rounds take turns, in an order that turns each round, so the proxy (the same kind of hop, whose
overhead `proxy_overhead.py` measures) is the peer in the same run. With at least 2 usable CPUs the
client and engine share one and the proxy and router the other, as pods would have their own CPU.
Reported per hop: the added p50 TTFT (target < 1 ms for the router) with the median and quartiles of
the per-round differences from the direct round, the output tokens/s lost, and each process's CPU
seconds per 1000 output tokens; and the per-round difference of the router from the proxy beside
that of a second, identical proxy (`proxy_again`) from the first: two equal hops' difference in the
same run is the noise the router's is read against. The prompt is
`--prompt-chars` characters (about a quarter as many tokens), so the router's hashing of it counts.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import uvloop

from decodeservice.common.stats import percentile
from decodeservice.loadgen.procs import ChildServer, decodectl, free_port

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from json_out import emit
from proxy_overhead import (
    OVERHEAD_POLICY,
    _cpu_per_1k,
    _measured,
    _pinning,
    _spawned_on,
    closed_loop,
    load_client,
    proxy,
    run_load,
)

from tests.support.fake_engine import FakeEngine, serve_loopback


@contextlib.asynccontextmanager
async def router(endpoint: str, *, logs: Path, cpus: set[int] | None) -> AsyncIterator[ChildServer]:
    port = free_port()
    argv = decodectl("router", "--host", "127.0.0.1", "--port", str(port), "--endpoints", endpoint,
                     "--log-level", "warning")
    child = ChildServer(name="router", argv=argv, url=f"http://127.0.0.1:{port}", log_path=logs / "router.log")
    try:
        with _spawned_on(cpus):
            child.start()
        await child.wait_ready(timeout_s=60.0, path="/health")
        yield child
    finally:
        child.stop()


async def _rounds(args: argparse.Namespace, load: dict[str, Any], pins: tuple[set[int], set[int]] | None,
                  logs: Path) -> dict[str, list[dict[str, Any]]]:
    engine = FakeEngine(ttft_s=args.ttft_ms / 1000.0, itl_s=args.itl_ms / 1000.0, default_tokens=args.tokens)
    hop_cpus = None if pins is None else pins[1]
    (logs / "again").mkdir()  # the second proxy's log and policy file
    async with serve_loopback(engine.app()) as engine_url:
        engine.url = engine_url
        async with router(engine_url, logs=logs, cpus=hop_cpus) as routed, \
                proxy(engine_url, OVERHEAD_POLICY, logs=logs, cpus=hop_cpus) as proxied, \
                proxy(engine_url, OVERHEAD_POLICY, logs=logs / "again", cpus=hop_cpus) as again:
            assert routed.pid is not None and proxied.pid is not None and again.pid is not None
            pids = {"client_and_engine": os.getpid(), "proxy": proxied.pid, "router": routed.pid,
                    "proxy_again": again.pid}
            # A second, identical proxy: what two equal hops differ by in this run is the noise floor
            # against which the router's difference from the proxy is read.
            urls = {"direct": engine_url, "proxy": proxied.url, "router": routed.url, "proxy_again": again.url}
            rows: dict[str, list[dict[str, Any]]] = {name: [] for name in urls}
            width = int(load["level"].value)
            async with contextlib.AsyncExitStack() as stack:
                clients = {name: await stack.enter_async_context(load_client(width)) for name in urls}
                for name, url in urls.items():  # warm-up: connections, imports
                    await run_load(url, client=clients[name], **load)
                names = list(urls)
                for rnd in range(args.rounds):
                    # The order turns each round, so each hop takes each place in it equally often and
                    # whatever a place costs (the round before it, what the other processes on the core
                    # were left doing) falls on every hop alike instead of on the last one.
                    order = names[rnd % len(names):] + names[:rnd % len(names)]
                    for position, name in enumerate(order):
                        row = await _measured(urls[name], pids, client=clients[name], **load)
                        rows[name].append(row | {"position": position, "load_average_1m": os.getloadavg()[0]})
            return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--ttft-ms", type=float, default=20.0)
    parser.add_argument("--itl-ms", type=float, default=10.0)
    parser.add_argument("--prompt-chars", type=int, default=2400)
    parser.add_argument("--pin", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    prompt = ("word " * (args.prompt_chars // 5 + 1))[: args.prompt_chars]
    body = {"model": "fake-model", "prompt": prompt, "max_tokens": args.tokens, "stream": True}
    load = {"level": closed_loop(args.concurrency), "requests": args.concurrency, "body": body}
    pins = _pinning(args.pin)
    with tempfile.TemporaryDirectory() as tmp:
        if pins is not None:
            os.sched_setaffinity(0, pins[0])
        load_start = [round(x, 2) for x in os.getloadavg()]
        rows = uvloop.run(_rounds(args, load, pins, Path(tmp)))
        load_end = [round(x, 2) for x in os.getloadavg()]

    def med(name: str, key: str) -> float:
        return percentile([float(r[key]) for r in rows[name]], 50)

    def hop(name: str) -> dict[str, Any]:
        paired = [r["ttft_p50_ms"] - d["ttft_p50_ms"] for d, r in zip(rows["direct"], rows[name], strict=True)]
        return {"ttft_p50_ms": med(name, "ttft_p50_ms"), "output_tokens_per_s": med(name, "output_tokens_per_s"),
                "added_ttft_p50_ms": med(name, "ttft_p50_ms") - med("direct", "ttft_p50_ms"),
                "added_ttft_p50_ms_paired": {"median": percentile(paired, 50), "q1": percentile(paired, 25),
                                             "q3": percentile(paired, 75)},
                "throughput_loss_pct": 100.0 * (1 - med(name, "output_tokens_per_s")
                                                / med("direct", "output_tokens_per_s")),
                "cpu_s_per_1k_output_tokens": _cpu_per_1k(rows[name]),
                "ttft_p50_ms_by_position": by_position(name)}

    def between(name: str, peer: str) -> dict[str, float]:
        paired = [r["ttft_p50_ms"] - p["ttft_p50_ms"] for p, r in zip(rows[peer], rows[name], strict=True)]
        return {"median": percentile(paired, 50), "q1": percentile(paired, 25), "q3": percentile(paired, 75)}

    def by_position(name: str) -> dict[str, float]:
        return {str(p): percentile([float(r["ttft_p50_ms"]) for r in rows[name] if r["position"] == p], 50)
                for p in sorted({r["position"] for r in rows[name]})}

    result = {
        "study": "routing_overhead", "command": "benchmarks/routing_overhead.py " + " ".join(sys.argv[1:]),
        "config": {"concurrency": args.concurrency, "tokens": args.tokens, "ttft_ms": args.ttft_ms,
                   "itl_ms": args.itl_ms, "rounds": args.rounds, "prompt_chars": args.prompt_chars,
                   "engine": "fake engine in the load generator's loop (uvloop)", "endpoints": 1},
        "hop_order": "turns each round (direct, proxy, router, proxy_again; then proxy, router, ...)",
        "load_average_1_5_15": {"start": load_start, "end": load_end},
        "pinning": None if pins is None else {"client_and_engine_cpus": sorted(pins[0]),
                                              "proxy_and_router_cpus": sorted(pins[1])},
        "direct": {"ttft_p50_ms": med("direct", "ttft_p50_ms"),
                   "output_tokens_per_s": med("direct", "output_tokens_per_s"),
                   "cpu_s_per_1k_output_tokens": _cpu_per_1k(rows["direct"]),
                   "ttft_p50_ms_by_position": by_position("direct")},
        "proxy": hop("proxy"), "router": hop("router"), "proxy_again": hop("proxy_again"),
        "router_minus_proxy_ttft_p50_ms_paired": between("router", "proxy"),
        "proxy_again_minus_proxy_ttft_p50_ms_paired": between("proxy_again", "proxy"),
        "targets": {"router_added_ttft_p50_ms": "< 1"},
        "rounds": rows,
    }
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
