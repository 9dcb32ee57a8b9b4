"""The long reliability runs: a soak through the proxy, and the fuzz suite at a larger scale.

    .venv/bin/python -P benchmarks/reliability.py soak --minutes 3 --concurrency 4
    .venv/bin/python -P benchmarks/reliability.py fuzz --scale 5

soak: `decodectl engine` (bundled model) and `decodectl proxy` run as child processes, each under
benchmarks/soak_child.py, which samples its RSS, open fds and live asyncio tasks every second. Clients
send mixed traffic (completions and chat, streamed or not, a fifth of the streams abandoned after two
events) for `--minutes`. Printed and saved as JSON (benchmarks/results/reliability_soak.json, with a PNG
plot beside it): tried / survived / lost, whether the proxy's and the engine's counters agree with what
the clients saw, whether the engine went back to idle, and the slope of each resource per minute
(least squares over the traffic after its first tenth, and over its second half).

fuzz: runs tests/reliability/test_fuzz.py with RELIABILITY_FUZZ_EXAMPLES_SCALE=`--scale` and collects
its JSON counts (benchmarks/results/reliability_fuzz.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from decodeservice.loadgen.procs import ChildServer, free_port

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run with -P from anywhere: the client-side counting lives in tests/
from tests.reliability.outcomes import Outcome, Tally, request, scrape, total  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
CHILD = ROOT / "benchmarks" / "soak_child.py"
PROMPTS = ["Once upon a time", "The capital of France is", "Write a haiku about the sea.",
           "List three prime numbers.", "Explain what a KV cache is in one sentence."]


def _child(name: str, stats: Path, argv: list[str], url: str, log_dir: Path) -> ChildServer:
    cmd = [sys.executable, "-P", str(CHILD), "--stats", str(stats), "--", *argv]
    return ChildServer(name=name, argv=cmd, url=url, log_path=log_dir / f"{name}.log")


def _body(rnd: random.Random) -> tuple[str, dict[str, Any], int | None]:
    chat = rnd.random() < 0.5
    body: dict[str, Any] = {"max_tokens": rnd.randint(4, 32), "temperature": rnd.choice([0, 0.7]),
                            "stream": rnd.random() < 0.7}
    if chat:
        body["messages"] = [{"role": "user", "content": rnd.choice(PROMPTS)}]
    else:
        body["prompt"] = rnd.choice(PROMPTS)
    leave = 2 if body["stream"] and rnd.random() < 0.2 else None
    return ("/v1/chat/completions" if chat else "/v1/completions"), body, leave


async def _traffic(client: httpx.AsyncClient, *, seconds: float, concurrency: int, seed: int) -> Tally:
    tally = Tally("soak")
    deadline = time.monotonic() + seconds

    async def worker(i: int) -> None:
        rnd = random.Random(seed * 1000 + i)
        while time.monotonic() < deadline:
            path, body, leave = _body(rnd)
            tally.add(await request(client, path, body, headers={"x-tenant": f"t{i % 3}"}, deadline_s=120,
                                    stop_after_chunks=leave))

    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return tally


def _slope_per_minute(rows: list[dict[str, Any]], key: str, window: tuple[float, float], skip: float) -> float:
    """Least-squares slope over the traffic window, after its first `skip` fraction (the warm-up)."""
    start, end = window
    start += (end - start) * skip
    rows = [r for r in rows if start <= r["wall"] <= end]
    if len(rows) < 3:
        return float("nan")
    xs = [r["wall"] / 60 for r in rows]
    ys = [float(r[key]) for r in rows]
    return statistics.linear_regression(xs, ys).slope


def _read_stats(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _plot(series: dict[str, list[dict[str, Any]]], window: tuple[float, float], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = min(rows[0]["wall"] for rows in series.values() if rows)
    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    for name, rows in series.items():
        t = [(r["wall"] - t0) / 60 for r in rows]
        axes[0].plot(t, [r["rss_kib"] / 1024 for r in rows], label=name)
        axes[1].plot(t, [r["fds"] for r in rows], label=name)
        axes[2].plot(t, [r["tasks"] for r in rows], label=name)
    for ax, label in zip(axes, ["RSS (MiB)", "open fds", "asyncio tasks"], strict=True):
        ax.set_ylabel(label)
        ax.axvspan((window[0] - t0) / 60, (window[1] - t0) / 60, color="0.9", zorder=0)
        ax.legend(loc="upper left")
    axes[2].set_xlabel("minutes since the engine started (shaded: traffic)")
    fig.suptitle("DecodeService soak: engine and proxy through mixed traffic with disconnects")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    RESULTS.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        engine_port, proxy_port = free_port(), free_port()
        engine_url, proxy_url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{proxy_port}"
        policy = work / "policy.yaml"
        policy.write_text("admission: {isolatePrefixCache: true, maxInflight: 16}\n")
        stats = {"engine": work / "engine.jsonl", "proxy": work / "proxy.jsonl"}
        engine = _child("engine", stats["engine"], [
            "engine", "--model", "smollm2-135m", "--port", str(engine_port), "--kv-cache-gib", "0.1",
            "--max-model-len", "1024", "--num-threads", str(args.threads), "--log-level", "warning"],
            engine_url, work)
        proxy = _child("proxy", stats["proxy"], [
            "proxy", "--upstream", engine_url, "--port", str(proxy_port), "--policy", str(policy),
            "--log-level", "warning"], proxy_url, work)
        engine.start()
        try:
            await engine.wait_ready(timeout_s=300)
            proxy.start()
            await proxy.wait_ready(timeout_s=60)
            async with httpx.AsyncClient(base_url=proxy_url, timeout=120) as client:
                proxy_before = scrape((await client.get("/metrics")).text)
                engine_before = scrape((await client.get(f"{engine_url}/metrics")).text)
                started, started_wall = time.monotonic(), time.time()
                tally = await _traffic(client, seconds=args.minutes * 60, concurrency=args.concurrency,
                                       seed=args.seed)
                ended, ended_wall = time.monotonic(), time.time()
                # Idle: gauges back to zero (they are refreshed after each engine step or abort).
                idle_deadline = time.monotonic() + 60
                while True:
                    engine_after = scrape((await client.get(f"{engine_url}/metrics")).text)
                    busy = (total(engine_after, "vllm:num_requests_running")
                            + total(engine_after, "vllm:num_requests_waiting")
                            + total(engine_after, "vllm:kv_cache_usage_perc"))
                    if busy == 0 or time.monotonic() > idle_deadline:
                        break
                    await asyncio.sleep(0.2)
                # A few idle samples after the traffic, so the plot shows where things settle.
                await asyncio.sleep(5)
                proxy_after = scrape((await client.get("/metrics")).text)
        finally:
            proxy.stop()
            engine.stop()
        series = {name: _read_stats(path) for name, path in stats.items()}

    def delta(after: Any, before: Any, name: str, **labels: str) -> int:
        return int(total(after, name, **labels) - total(before, name, **labels))

    summary = tally.summary()
    full = summary["outcomes"].get(Outcome.FULL.value, 0)
    left = summary["outcomes"].get(Outcome.DISCONNECTED.value, 0)
    counters = {
        "clients_full": full, "clients_disconnected": left, "clients_tried": tally.tried,
        "proxy_answered": delta(proxy_after, proxy_before, "decode_proxy:requests_total"),
        "proxy_200": delta(proxy_after, proxy_before, "decode_proxy:requests_total", status="200"),
        "proxy_499": delta(proxy_after, proxy_before, "decode_proxy:requests_total", status="499"),
        "engine_finished": delta(engine_after, engine_before, "vllm:request_success_total")
        - delta(engine_after, engine_before, "vllm:request_success_total", finished_reason="abort"),
        "engine_aborted": delta(engine_after, engine_before, "vllm:request_success_total", finished_reason="abort"),
    }
    # A client that leaves after the last token was relayed is a 200 and a finished request on both
    # sides; so the sides must agree with each other exactly, and with the clients up to those.
    counters["agree"] = (counters["proxy_answered"] == tally.tried
                         and counters["proxy_200"] == counters["engine_finished"]
                         and counters["proxy_499"] == counters["engine_aborted"]
                         and full <= counters["proxy_200"] <= full + left)
    window = (started_wall, ended_wall)
    result = {
        "benchmark": "reliability_soak", "minutes": args.minutes, "concurrency": args.concurrency,
        "threads": args.threads, "requests_per_second": round(tally.tried / (ended - started), 2),
        **{k: summary[k] for k in ("tried", "survived", "lost", "outcomes", "statuses")},
        "lost_examples": summary.get("lost_examples", []), "counters": counters, "engine_idle_after": busy == 0,
        # After the first tenth of the traffic, and over its second half (once warm-up growth is done).
        **{f"slopes_per_minute_{label}": {
            name: {"rss_mib": round(_slope_per_minute(rows, "rss_kib", window, skip) / 1024, 3),
                   "fds": round(_slope_per_minute(rows, "fds", window, skip), 3),
                   "tasks": round(_slope_per_minute(rows, "tasks", window, skip), 3)}
            for name, rows in series.items()} for label, skip in (("after_first_tenth", 0.1), ("second_half", 0.5))},
        # Each resource at the traffic's start and at the end of the run (after the idle tail).
        "start_end": {name: {k: (next(r[k] for r in rows if r["wall"] >= started_wall), rows[-1][k])
                             for k in ("rss_kib", "fds", "tasks")} for name, rows in series.items() if rows},
        "samples": {name: len(rows) for name, rows in series.items()},
    }
    out = RESULTS / f"{args.name}.json"
    out.write_text(json.dumps({**result, "series": series}, indent=1) + "\n")
    _plot(series, window, RESULTS / f"{args.name}.png")
    return result


def fuzz(args: argparse.Namespace) -> dict[str, Any]:
    env = {**os.environ, "RELIABILITY_FUZZ_EXAMPLES_SCALE": str(args.scale)}
    proc = subprocess.run([sys.executable, "-P", "-m", "pytest", "tests/reliability/test_fuzz.py", "-q", "-p",
                           "no:cacheprovider"], cwd=ROOT, env=env, capture_output=True, text=True)
    counts = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"scenario"')]
    result = {"benchmark": "reliability_fuzz", "scale": args.scale, "pytest_exit": proc.returncode,
              "scenarios": [c for c in counts if c["scenario"] != "TOTAL"],
              "total": next((c for c in counts if c["scenario"] == "TOTAL"), None)}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    if proc.returncode != 0:
        print(proc.stdout[-4000:], file=sys.stderr)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    s = sub.add_parser("soak")
    s.add_argument("--minutes", type=float, default=3.0)
    s.add_argument("--concurrency", type=int, default=4)
    s.add_argument("--threads", type=int, default=1, help="engine torch threads")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--name", default="reliability_soak")
    f = sub.add_parser("fuzz")
    f.add_argument("--scale", type=float, default=5.0)
    f.add_argument("--name", default="reliability_fuzz")
    args = parser.parse_args(argv)
    result = asyncio.run(soak(args)) if args.mode == "soak" else fuzz(args)
    print(json.dumps(result, indent=1))
    return 0 if result.get("lost", 0) == 0 and result.get("pytest_exit", 0) == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
