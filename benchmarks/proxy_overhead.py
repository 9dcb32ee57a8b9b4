"""Proxy overhead and batching-window sweep.

Overhead mode (default): starts the fake engine (`decodeservice.bench.fake_engine`) and `decodectl proxy`
as subprocesses on loopback, then runs `--concurrency` concurrent streams directly against the engine and
through the proxy, alternating for `--rounds` rounds. Reports the added p50 TTFT (target < 1 ms) and the
output tokens/s lost (target < 2 %).

Sweep mode (`--engine-url URL`): for each batching window (default 0, 5, 20, 50 ms) starts a proxy in
front of that engine with the window on the `batch` class, sends `batch` streams, and reports throughput
and TTFT per window.

    python benchmarks/proxy_overhead.py --out overhead.json
    python benchmarks/proxy_overhead.py --engine-url http://127.0.0.1:8001 --out sweep.json

JSON goes to stdout (and to `--out FILE`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _wait_up(url: str, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not come up")
        time.sleep(0.05)


@contextlib.contextmanager
def _process(argv: list[str], url: str) -> Iterator[str]:
    proc = subprocess.Popen(argv, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.DEVNULL)
    try:
        _wait_up(url, proc)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def fake_engine(*, ttft_ms: float, itl_ms: float, tokens: int) -> Iterator[str]:
    port = _free_port()
    argv = [sys.executable, "-P", "-m", "decodeservice.bench.fake_engine", "--port", str(port), "--ttft-ms", str(ttft_ms),
            "--itl-ms", str(itl_ms), "--tokens", str(tokens)]
    with _process(argv, f"http://127.0.0.1:{port}") as url:
        yield url


@contextlib.contextmanager
def proxy(upstream: str, policy_yaml: str) -> Iterator[str]:
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        policy = Path(tmp) / "policy.yaml"
        policy.write_text(policy_yaml)
        argv = [sys.executable, "-P", "-m", "decodeservice.cli.main", "proxy", "--upstream", upstream, "--port", str(port),
                "--policy", str(policy), "--log-level", "warning"]
        with _process(argv, f"http://127.0.0.1:{port}") as url:
            yield url


async def _one_stream(client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str],
                      ) -> tuple[float | None, int, int]:
    """(TTFT seconds, token events, HTTP status) of one streamed completion."""
    start = time.perf_counter()
    ttft = None
    tokens = 0
    async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            await r.aread()
            return None, 0, r.status_code
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or []
            if any(c.get("text") for c in choices):
                tokens += 1
                if ttft is None:
                    ttft = time.perf_counter() - start
    return ttft, tokens, 200


async def run_load(url: str, *, concurrency: int, requests: int, body: dict[str, Any],
                   headers: dict[str, str] | None = None) -> dict[str, Any]:
    """`requests` streams, at most `concurrency` at once; TTFT percentiles and output tokens/s."""
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:
        sem = asyncio.Semaphore(concurrency)

        async def one() -> tuple[float | None, int, int]:
            async with sem:
                return await _one_stream(client, url, body, headers or {})

        start = time.perf_counter()
        results = await asyncio.gather(*(one() for _ in range(requests)))
        wall = time.perf_counter() - start
    ttfts = sorted(t for t, _, _ in results if t is not None)
    tokens = sum(n for _, n, _ in results)
    return {
        "requests": requests, "ok": sum(1 for *_, s in results if s == 200), "wall_s": wall,
        "output_tokens": tokens, "output_tokens_per_s": tokens / wall,
        "ttft_p50_ms": statistics.median(ttfts) * 1000 if ttfts else None,
        "ttft_p95_ms": ttfts[int(0.95 * (len(ttfts) - 1))] * 1000 if ttfts else None,
    }


OVERHEAD_POLICY = """\
admission: {maxInflight: 256}
classes:
  interactive: {batchWindowMs: 0, maxBatch: 1, maxQueue: 1024}
"""


def overhead(args: argparse.Namespace) -> dict[str, Any]:
    body = {"model": "fake-model", "prompt": "hello", "max_tokens": args.tokens, "stream": True}
    n = args.concurrency
    direct: list[dict[str, Any]] = []
    proxied: list[dict[str, Any]] = []
    with fake_engine(ttft_ms=args.ttft_ms, itl_ms=args.itl_ms, tokens=args.tokens) as engine_url, \
            proxy(engine_url, OVERHEAD_POLICY) as proxy_url:
        asyncio.run(run_load(proxy_url, concurrency=n, requests=n, body=body))  # warm-up: connections, imports
        asyncio.run(run_load(engine_url, concurrency=n, requests=n, body=body))
        for _ in range(args.rounds):  # alternate so machine noise hits both sides alike
            direct.append(asyncio.run(run_load(engine_url, concurrency=n, requests=n, body=body)))
            proxied.append(asyncio.run(run_load(proxy_url, concurrency=n, requests=n, body=body)))

    def med(rows: list[dict[str, Any]], key: str) -> float:
        return float(statistics.median(r[key] for r in rows))

    d_ttft, p_ttft = med(direct, "ttft_p50_ms"), med(proxied, "ttft_p50_ms")
    d_tps, p_tps = med(direct, "output_tokens_per_s"), med(proxied, "output_tokens_per_s")
    return {
        "mode": "overhead",
        "config": {"concurrency": n, "tokens": args.tokens, "ttft_ms": args.ttft_ms, "itl_ms": args.itl_ms,
                   "rounds": args.rounds},
        "direct": {"ttft_p50_ms": d_ttft, "output_tokens_per_s": d_tps},
        "proxy": {"ttft_p50_ms": p_ttft, "output_tokens_per_s": p_tps},
        "added_ttft_p50_ms": p_ttft - d_ttft,
        "throughput_loss_pct": 100.0 * (d_tps - p_tps) / d_tps,
        "targets": {"added_ttft_p50_ms": "< 1", "throughput_loss_pct": "< 2"},
        "rounds": {"direct": direct, "proxy": proxied},
    }


def sweep(args: argparse.Namespace) -> dict[str, Any]:
    engine_url = args.engine_url.rstrip("/")
    model = args.model or httpx.get(engine_url + "/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "prompt": args.prompt, "max_tokens": args.tokens, "stream": True, "temperature": 0}
    rows = []
    for window in args.windows:
        policy = (f"admission: {{maxInflight: {max(64, args.concurrency)}}}\n"
                  f"classes:\n  batch: {{batchWindowMs: {window}, maxBatch: {args.max_batch}, maxQueue: 4096}}\n")
        with proxy(engine_url, policy) as proxy_url:
            result = asyncio.run(run_load(proxy_url, concurrency=args.concurrency, requests=args.requests,
                                          body=body, headers={"x-priority": "batch"}))
        rows.append({"batch_window_ms": window, **result})
    return {"mode": "window_sweep", "engine_url": engine_url, "model": model,
            "config": {"concurrency": args.concurrency, "requests": args.requests, "tokens": args.tokens,
                       "max_batch": args.max_batch},
            "windows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64, help="max_tokens per stream")
    parser.add_argument("--rounds", type=int, default=3, help="overhead mode: alternating rounds")
    parser.add_argument("--ttft-ms", type=float, default=20.0, help="overhead mode: fake engine TTFT")
    parser.add_argument("--itl-ms", type=float, default=10.0, help="overhead mode: fake engine ITL")
    parser.add_argument("--engine-url", help="sweep mode: a running engine (ours, vLLM, or the fake)")
    parser.add_argument("--windows", type=lambda s: [float(x) for x in s.split(",")], default=[0, 5, 20, 50],
                        help="sweep mode: batching windows in ms (default 0,5,20,50)")
    parser.add_argument("--max-batch", type=int, default=16, help="sweep mode: maxBatch of the batch class")
    parser.add_argument("--requests", type=int, default=128, help="sweep mode: requests per window")
    parser.add_argument("--model", help="sweep mode: model name (default: the first of GET /v1/models)")
    parser.add_argument("--prompt", default="Once upon a time", help="sweep mode: prompt text")
    args = parser.parse_args(argv)
    if args.concurrency < 1 or args.tokens < 1 or args.rounds < 1:
        parser.error("--concurrency, --tokens and --rounds must be >= 1")
    report = sweep(args) if args.engine_url else overhead(args)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
