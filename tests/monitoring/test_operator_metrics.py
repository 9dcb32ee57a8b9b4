"""The operator's /metrics: each DecodeService's replicas, autoscaler signal and cold start, from its status.

The end-to-end test runs the operator (kopf, the real registry plus `operator.metrics.install`) against
the in-process Kubernetes API emulator and scrapes the served /metrics over loopback.
"""

from __future__ import annotations

import asyncio
import copy
import subprocess
import sys
from typing import Any

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from decodeservice.operator.metrics import figures
from tests.monitoring.prometheus_server import free_port
from tests.operator.conftest import Cluster, run_operator
from tests.operator.helpers import EXAMPLES
from tests.support.kube_emulator import DEPLOYMENTS

DS_PATH = "/apis/decode.dev/v1alpha1/namespaces/default/decodeservices"


def smoke(**spec: Any) -> dict[str, Any]:
    body = copy.deepcopy(yaml.safe_load((EXAMPLES / "cpu-smoke.yaml").read_text()))
    body["metadata"]["namespace"] = "default"
    body["spec"].update(spec)
    return body


def test_figures_read_the_spec_and_the_status() -> None:
    body = smoke(replicas=3)
    body["status"] = {"replicas": 3, "readyReplicas": 2, "coldStart": {"lastSeconds": 41.5, "replicas": 2}}
    f = figures(body)
    assert (f.namespace, f.name, f.desired, f.current, f.ready) == ("default", "smollm2-cpu", 3, 3, 2)
    assert f.signal is None and f.cold_start_seconds == 41.5


def test_builtin_autoscaling_wants_what_the_autoscaler_decided() -> None:
    body = smoke(autoscaling={"mode": "builtin", "minReplicas": 1, "maxReplicas": 4})
    assert figures(body).desired == 1  # no decision yet: the spec's replicas within the bounds
    body["status"] = {"slo": {"desiredReplicas": 3, "signal": 1.7}}
    f = figures(body)
    assert f.desired == 3 and f.signal == 1.7


def test_an_invalid_spec_wants_nothing() -> None:
    body = smoke()
    body["spec"]["resources"]["gpus"] = -1
    assert figures(body).desired is None


def test_a_bad_metrics_url_exits_2() -> None:
    result = subprocess.run([sys.executable, "-P", "-m", "decodeservice.cli.main", "operator", "--metrics",
                             "http://0.0.0.0:notaport/metrics"], capture_output=True, text=True, timeout=60,
                            check=False)
    assert result.returncode == 2
    assert "--metrics must look like http://HOST:PORT/metrics" in result.stderr


async def _samples(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    async with httpx.AsyncClient(timeout=5.0) as client:
        try:
            text = (await client.get(url)).text
        except httpx.HTTPError:
            return {}
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


async def _wait_shows(url: str, wanted: dict[Any, float], what: str) -> None:
    current: dict[Any, float] = {}
    for _ in range(500):  # bounded: about 10 s of 20 ms polls
        current = await _samples(url)
        if all(current.get(k) == v for k, v in wanted.items()):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}; /metrics had {current}")


async def test_the_operator_serves_each_services_figures(cluster: Cluster) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    ns = (("name", "smollm2-cpu"), ("namespace", "default"))

    def key(name: str, **labels: str) -> tuple[str, tuple[tuple[str, str], ...]]:
        return name, tuple(sorted((*ns, *labels.items())))

    async for _ in run_operator(cluster, metrics_port=port):
        await cluster.create(smoke(replicas=2))
        await _wait_shows(url, {key("decodeservice_replicas", state="desired"): 2.0,
                                key("decodeservice_replicas", state="ready"): 0.0}, "desired 2, ready 0")
        assert key("decodeservice_cold_start_seconds") not in await _samples(url)
        await cluster.wait_for(lambda: cluster.get(DEPLOYMENTS, "smollm2-cpu"), what="the Deployment")
        # The Deployment's pods become ready (what the kubelet would report; the operator's resync copies
        # it into the DecodeService's status), and a cold start is measured.
        await cluster.patch("/apis/apps/v1/namespaces/default/deployments/smollm2-cpu/status", {"status": {
            "observedGeneration": 1, "replicas": 2, "readyReplicas": 2, "updatedReplicas": 2,
            "availableReplicas": 2}})
        await cluster.patch(f"{DS_PATH}/smollm2-cpu/status", {"status": {
            "coldStart": {"lastSeconds": 33.0, "replicas": 2}}})
        await _wait_shows(url, {key("decodeservice_replicas", state="ready"): 2.0,
                                key("decodeservice_replicas", state="current"): 2.0,
                                key("decodeservice_cold_start_seconds"): 33.0}, "ready 2 and the cold start")
        await cluster.delete(f"{DS_PATH}/smollm2-cpu")
        for _ in range(500):  # bounded, as above
            if not any(k[0] == "decodeservice_replicas" for k in await _samples(url)):
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError("a deleted DecodeService's series stayed")
