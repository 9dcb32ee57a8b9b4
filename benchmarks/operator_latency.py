"""Time from DecodeService creation to its Deployment existing, against kmock's KubernetesEmulator.

    .venv/bin/python benchmarks/operator_latency.py --count 20

Prints one JSON object: the latency percentiles in milliseconds and whether p95 meets the 1 s target.
The operator runs in-process (kopf in its own thread, as in production it runs in its own process) and
talks HTTP to the emulator on 127.0.0.1, so the figure includes watch delivery, the handler, and the
child API calls, but no real API server or etcd latency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import kopf
from kmock import Server, resource

from decodeservice.common.stats import percentile
from decodeservice.operator.handlers import OperatorConfig, build_registry

# The API emulator is test support, outside the installed packages: this study runs from a checkout.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.support.kube_emulator import DEPLOYMENTS, ApiServer, declare_resources

TARGET_MS = 1000.0


def _settings() -> kopf.OperatorSettings:
    settings = kopf.OperatorSettings()
    settings.watching.server_timeout = 30
    settings.watching.connect_timeout = 2
    settings.posting.enabled = False
    return settings


async def measure(count: int) -> list[float]:
    latencies: list[float] = []
    async with ApiServer() as server, Server(server) as http:
        declare_resources(server)
        config = OperatorConfig(resync_seconds=3600, connection=kopf.ConnectionInfo(server=str(http.url), insecure=True))
        stop, ready = threading.Event(), threading.Event()
        thread = threading.Thread(target=lambda: asyncio.run(kopf.operator(
            registry=build_registry(config), settings=_settings(), clusterwide=True, standalone=True,
            stop_flag=stop, ready_flag=ready)), daemon=True)
        thread.start()
        try:
            if not await asyncio.to_thread(ready.wait, 30):
                raise RuntimeError("kopf did not start")
            deployments = resource(DEPLOYMENTS)
            for i in range(count):
                name = f"bench-{i}"
                body = {"apiVersion": "decode.dev/v1alpha1", "kind": "DecodeService",
                        "metadata": {"name": name, "namespace": "default"},
                        "spec": {"model": {"uri": "bundled://smollm2-135m"}}}
                start = time.perf_counter()
                async with server.post("/apis/decode.dev/v1alpha1/namespaces/default/decodeservices", json=body) as r:
                    r.raise_for_status()
                key = (deployments, "default", name)
                while key not in server.objects:
                    if time.perf_counter() - start > 30:
                        raise RuntimeError(f"no Deployment for {name} after 30 s")
                    await asyncio.sleep(0.002)
                latencies.append((time.perf_counter() - start) * 1000.0)
        finally:
            stop.set()
            await asyncio.to_thread(thread.join, 30)
    return latencies


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--count", type=int, default=20, help="DecodeServices to create, one after another")
    args = parser.parse_args()
    if args.count < 1:
        parser.error("--count must be >= 1")
    latencies = asyncio.run(measure(args.count))
    p95 = percentile(latencies, 95)
    print(json.dumps({
        "benchmark": "operator_create_to_deployment", "count": len(latencies),
        "p50_ms": round(percentile(latencies, 50), 1), "p95_ms": round(p95, 1),
        "max_ms": round(max(latencies), 1), "mean_ms": round(statistics.fmean(latencies), 1),
        "target_ms": TARGET_MS, "meets_target": p95 < TARGET_MS,
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
