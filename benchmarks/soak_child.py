"""Run `decodectl ARGS` while sampling this process's RSS, open fds and live asyncio tasks.

    python -P benchmarks/soak_child.py --stats engine.jsonl -- engine --model smollm2-135m --port 8001

Benchmark-only: the product exposes no task count (a debug endpoint would be an attack surface). A
sampler thread reads /proc/self and asyncio's registry of tasks (every loop's, uvloop's included: they
register through the same C module) once per `--every` seconds and appends one JSON line per sample.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import threading
import time
from pathlib import Path


def live_tasks() -> int:
    # The loops' WeakSet of tasks: asyncio.all_tasks() only sees the calling thread's loop.
    registry: set[asyncio.Task[object]] = asyncio.tasks._all_tasks  # type: ignore[attr-defined]
    for _ in range(10):
        try:
            return sum(1 for task in list(registry) if not task.done())
        except RuntimeError:  # the set changed while we copied it: try again
            continue
    return -1


def rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return -1


def sample_forever(path: Path, every: float, stop: threading.Event) -> None:
    start = time.monotonic()
    with path.open("a", buffering=1) as out:
        while not stop.wait(every):
            out.write(json.dumps({"t": round(time.monotonic() - start, 3), "wall": time.time(), "rss_kib": rss_kib(),
                                  "fds": len(os.listdir("/proc/self/fd")), "tasks": live_tasks()}) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--stats", type=Path, required=True)
    parser.add_argument("--every", type=float, default=1.0)
    parser.add_argument("decodectl", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    argv = args.decodectl[1:] if args.decodectl[:1] == ["--"] else args.decodectl
    stop = threading.Event()
    threading.Thread(target=sample_forever, args=(args.stats, args.every, stop), daemon=True).start()
    from decodeservice.cli.main import main as decodectl

    try:
        return int(decodectl(argv))
    finally:
        stop.set()


if __name__ == "__main__":
    raise SystemExit(main())
