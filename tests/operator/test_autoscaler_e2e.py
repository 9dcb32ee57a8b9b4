"""The builtin autoscaler end to end: kopf against the API emulator, pods played by loopback servers.

Each stand-in pod is a real HTTP server on 127.0.0.1 (its own port) serving the proxy's real
`ProxyMetrics` exposition. Every scrape first records the requests since the last one (20 per tick
interval) in the pod's current mode (slow: TTFT 3x the objective; fast: far under it), so load continues for as long as the test says and the
histograms change between ticks as the test decides. A small stand-in for the Deployment controller
creates and deletes ready pod objects (and their servers) to follow the Deployment's replicas.
"""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import yaml
from aiohttp import web
from kmock import action, resource

from decodeservice.operator.autoscaler.controller import AutoscalingConfig
from decodeservice.operator.autoscaler.scrape import ScrapeSettings
from decodeservice.operator.manifests import render, selector_labels
from decodeservice.proxy.metrics import ProxyMetrics
from decodeservice.proxy.policy import Policy, PriorityClass
from decodeservice.proxy.slo import RequestOutcome
from tests.operator.conftest import Cluster, run_operator
from tests.operator.helpers import EXAMPLES
from tests.support.kube_emulator import DEPLOYMENTS, DS, EVENTS, PODS

INTERVAL = 0.3
POLICY = Policy.model_validate({"slo": {"ttftMs": 1000, "itlMs": 200}})
# TTFT per mode: 3x the objective, a twentieth of it, or 0.6 s: inside the band between scaling down
# (signal under 0.5) and up (over 0.8), where nothing should move.
SECONDS = {"slow": 3.0, "fast": 0.05, "edge": 0.6}


@dataclass
class Pod:
    name: str
    service: str
    mode: str  # slow, busy, fast, edge, flap, idle, error (HTTP 500) or garbage
    metrics: ProxyMetrics = field(default_factory=lambda: ProxyMetrics(POLICY))
    scrapes: list[tuple[str, int]] = field(default_factory=list)  # (mode served, Deployment replicas then)
    runner: web.AppRunner | None = None
    last_scrape: float | None = None  # monotonic time of the previous scrape: the load is a constant rate


class Fleet:
    """Stand-in pods, and a stand-in Deployment controller that keeps their number at spec.replicas."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.pods: dict[str, Pod] = {}
        self.urls: dict[str, str] = {}  # the operator's scrape_overrides: a live view of this fleet
        self.modes: dict[str, str] = {}  # service -> mode of its new pods
        self._seq = 0

    def replicas(self, service: str) -> int:
        return int(((self.cluster.get(DEPLOYMENTS, service) or {}).get("spec") or {}).get("replicas") or 0)

    def of(self, service: str) -> list[Pod]:
        return [p for p in self.pods.values() if p.service == service]

    def set_mode(self, service: str, mode: str) -> None:
        self.modes[service] = mode
        for pod in self.of(service):
            pod.mode = mode

    async def _metrics(self, pod: Pod) -> web.Response:
        pod.scrapes.append((pod.mode, self.replicas(pod.service)))
        if pod.mode == "error":
            return web.Response(status=500, text="internal error")
        if pod.mode == "garbage":
            return web.Response(body=b"\x00\xff" * 1000 + b"decode_proxy:num_requests_running NaN\n")
        # busy: slow, and 80 requests in flight (five replicas' worth at 16 each): the demand guard.
        pod.metrics.running.set(80 if pod.mode == "busy" else 0)
        mode = pod.mode
        if mode == "flap":  # slow and fast on alternate scrapes
            mode = "slow" if len(pod.scrapes) % 2 else "fast"
        if mode in SECONDS or mode == "busy":
            ttft = SECONDS.get(mode, SECONDS["slow"])
            # 20 requests per interval, as a rate: a tick delayed by a loaded machine (and the quicker one
            # after it) sees the same requests per second, not 20 per scrape however close the scrapes.
            now = time.monotonic()
            elapsed = INTERVAL if pod.last_scrape is None else now - pod.last_scrape
            pod.last_scrape = now
            for _ in range(round(20 * elapsed / INTERVAL)):
                pod.metrics.record(RequestOutcome(priority=PriorityClass.INTERACTIVE, finished=time.perf_counter(),
                                                  ttft=ttft, upstream_ttft=ttft, service_time=ttft + 0.1,
                                                  e2e=ttft + 0.1, itls=(0.01, 0.01), output_tokens=3))
        return web.Response(body=pod.metrics.render(), content_type="text/plain")

    async def add_pod(self, service: str, mode: str | None = None) -> Pod:
        self._seq += 1
        pod = Pod(name=f"{service}-{self._seq}", service=service, mode=mode or self.modes.get(service, "idle"))
        async def metrics(_: web.Request) -> web.Response:
            return await self._metrics(pod)

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        pod.runner = web.AppRunner(app)
        await pod.runner.setup()
        site = web.TCPSite(pod.runner, "127.0.0.1", 0)
        await site.start()
        self.urls[pod.name] = f"http://127.0.0.1:{pod.runner.addresses[0][1]}"
        self.pods[pod.name] = pod
        # As a kubelet would report it: running, ready, with an IP.
        body = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": pod.name, "namespace": "default",
                                                                 "labels": selector_labels(service)},
                "status": {"phase": "Running", "podIP": "127.0.0.1",
                           "conditions": [{"type": "Ready", "status": "True"}]}}
        async with self.cluster.server.post("/api/v1/namespaces/default/pods", json=body) as resp:
            assert resp.status < 300, await resp.text()
        return pod

    async def remove_pod(self, pod: Pod) -> None:
        await self.cluster.delete(f"/api/v1/namespaces/default/pods/{pod.name}")
        self.pods.pop(pod.name)
        self.urls.pop(pod.name, None)
        assert pod.runner is not None
        await pod.runner.cleanup()

    async def follow(self, service: str) -> None:
        while True:
            want, have = self.replicas(service), self.of(service)
            if len(have) < want:
                await self.add_pod(service)
            elif len(have) > want:
                await self.remove_pod(have[-1])
            else:
                await asyncio.sleep(0.02)

    async def close(self) -> None:
        for pod in list(self.pods.values()):
            assert pod.runner is not None
            await pod.runner.cleanup()


@pytest.fixture
async def fleet(cluster: Cluster) -> AsyncIterator[Fleet]:
    fleet = Fleet(cluster)
    # The default 2 s scrape timeout: on a loaded machine a loopback answer can take longer than a tick,
    # and a timed-out scrape is a failed pod, which would change what the tick decides.
    config = AutoscalingConfig(interval_seconds=INTERVAL, scrape=ScrapeSettings(timeout_seconds=2.0),
                               scrape_overrides=fleet.urls)
    try:
        async for _ in run_operator(cluster, resync_seconds=0.5, autoscaling=config):
            yield fleet
    finally:
        await fleet.close()


def service(name: str, *, replicas: int = 1, **autoscaling: Any) -> dict[str, Any]:
    body = copy.deepcopy(yaml.safe_load((EXAMPLES / "cpu-smoke.yaml").read_text()))
    body["metadata"]["name"] = name
    body["spec"]["replicas"] = replicas
    body["spec"]["policies"]["slo"] = {"ttftMs": 1000, "itlMs": 200}
    # The pod-side decision alone: no routers stand in here (test_scale_to_zero_e2e.py has them), and the
    # router's children would only lengthen each reconcile, which holds the lock a tick waits on.
    body["spec"]["routing"] = {"mode": "service"}
    body["spec"]["autoscaling"] = {"mode": "builtin", "minReplicas": 1, "maxReplicas": 3,
                                   "intervalSeconds": INTERVAL, "stableWindowSeconds": 1.5,
                                   "panicWindowSeconds": 0.6, "scaleDownDelaySeconds": 1, **autoscaling}
    return body


def slo(cluster: Cluster, name: str) -> dict[str, Any]:
    return dict(((cluster.get(DS, name) or {}).get("status") or {}).get("slo") or {})


def slo_met(cluster: Cluster, name: str) -> dict[str, Any]:
    for cond in ((cluster.get(DS, name) or {}).get("status") or {}).get("conditions") or []:
        if cond["type"] == "SLOMet":
            return dict(cond)
    return {}


def events(cluster: Cluster, name: str) -> list[dict[str, Any]]:
    found = [cluster.get(EVENTS, e) for e in cluster.names(EVENTS)]
    return [e for e in found if e and e["involvedObject"]["name"] == name]


def replica_writes(cluster: Cluster, name: str) -> list[int]:
    """Every replicas value the operator sent the Deployment (creates and patches)."""
    writes = []
    for verb in (action.CREATE, action.UPDATE):
        for req in cluster.server[verb, resource(DEPLOYMENTS)]:
            data = req.data if isinstance(req.data, dict) else {}
            if (req.name or data.get("metadata", {}).get("name")) == name and "replicas" in data.get("spec", {}):
                writes.append(int(data["spec"]["replicas"]))
    return writes


async def test_breach_scales_up_within_one_interval_up_to_max_then_down_after_the_window(fleet: Fleet) -> None:
    cluster = fleet.cluster
    follower = asyncio.create_task(fleet.follow("svc"))
    try:
        fleet.set_mode("svc", "fast")
        await cluster.create(service("svc"))
        await cluster.wait_for(lambda: len(fleet.of("svc")) == 1 and len(fleet.of("svc")[0].scrapes) >= 3,
                               what="three healthy ticks")
        assert fleet.replicas("svc") == 1
        await cluster.wait_for(lambda: slo_met(cluster, "svc").get("status") == "True", what="SLOMet True")
        first = fleet.of("svc")[0]

        fleet.set_mode("svc", "slow")
        breach = len(first.scrapes)  # the index of the first scrape that serves slow requests
        await cluster.wait_for(lambda: len(first.scrapes) >= breach + 2, what="the tick after the breach")
        # That tick's decision was written before the next tick scraped: up within one interval.
        assert first.scrapes[breach][0] == "slow" and first.scrapes[breach + 1][1] >= 2, (first.scrapes,
                                                                                           slo(cluster, "svc"))

        await cluster.wait_for(lambda: fleet.replicas("svc") == 3, timeout=15, what="max replicas")
        status = await cluster.wait_for(lambda: slo(cluster, "svc") if slo(cluster, "svc").get("desiredReplicas") == 3
                                        else None, what="status.slo of the scale-up")
        assert status["desiredReplicas"] >= 2 and status["signal"] > 0.8 and status["lastScaleTime"]
        # A sudden breach at 3x the objective is a burst: panic, shown in the status while it lasts.
        await cluster.wait_for(lambda: slo(cluster, "svc").get("panic") is True, what="panic in status.slo")
        interactive = next(c for c in status["classes"] if c["name"] == "interactive")
        assert interactive["ttftAttainment"] < 0.95 and interactive["signal"] > 0.8
        met = slo_met(cluster, "svc")
        assert (met["status"], met["reason"]) == ("False", "ObjectivesMissed")
        up = [e for e in events(cluster, "svc") if e["reason"] == "ScaledUp"]
        assert any(e["message"].startswith("1 -> ") for e in up), up
        assert all(e["type"] == "Normal" and e["involvedObject"]["kind"] == "DecodeService" for e in up)

        # The autoscaler applied only the replicas, under its own field manager: the rest stays the operator's.
        dep = cluster.get(DEPLOYMENTS, "svc") or {}
        assert [c["name"] for c in dep["spec"]["template"]["spec"]["containers"]] == ["engine", "proxy"]
        managers = {(m["manager"], m["operation"]) for m in dep["metadata"].get("managedFields") or []}
        assert {("decodeservice-autoscaler", "Apply"), ("decodeservice-operator", "Apply")} <= managers, managers

        # Max holds: four more ticks of breach never write more than 3.
        ticks = len(first.scrapes)
        await cluster.wait_for(lambda: len(first.scrapes) >= ticks + 4, what="four ticks at max")
        assert max(replica_writes(cluster, "svc")) == 3 and fleet.replicas("svc") == 3

        # Recovery: down only once the scale-down delay (1 s) has passed, then down to min, which holds.
        recovered = time.monotonic()
        fleet.set_mode("svc", "fast")
        await cluster.wait_for(lambda: fleet.replicas("svc") < 3, timeout=20, what="a scale-down")
        assert time.monotonic() - recovered >= 1.0
        await cluster.wait_for(lambda: fleet.replicas("svc") == 1, timeout=20, what="min replicas")
        pod = fleet.of("svc")[0]
        ticks = len(pod.scrapes)
        await cluster.wait_for(lambda: len(pod.scrapes) >= ticks + 4, what="four ticks at min")
        assert fleet.replicas("svc") == 1 and min(replica_writes(cluster, "svc")) == 1
        assert any(e["reason"] == "ScaledDown" for e in events(cluster, "svc"))
        await cluster.wait_for(lambda: slo_met(cluster, "svc").get("status") == "True", what="SLOMet again")
        # The resync (every 0.5 s) kept the autoscaler's replicas instead of spec.replicas.
        assert (cluster.get(DS, "svc") or {})["spec"]["replicas"] == 1
    finally:
        if follower.done():
            follower.result()  # the stand-in controller died: show why
        follower.cancel()


async def test_failing_and_garbage_pods_do_not_block(fleet: Fleet) -> None:
    cluster = fleet.cluster
    # The readable pod carries five replicas' worth of requests; the other two cannot be read. As the
    # HPA does, the unreadable ones count as no load for scaling up: they neither block nor inflate it.
    await fleet.add_pod("mixed", "busy")
    await fleet.add_pod("mixed", "error")
    await fleet.add_pod("mixed", "garbage")
    await cluster.create(service("mixed", minReplicas=3, maxReplicas=4))  # 3 pods exist: start at 3
    await cluster.wait_for(lambda: fleet.replicas("mixed") == 4, timeout=15, what="scale-up despite broken pods")
    # The Deployment is written first, then the status: wait for the status of that decision.
    status = await cluster.wait_for(lambda: slo(cluster, "mixed") if slo(cluster, "mixed").get("desiredReplicas") == 4
                                    else None, what="status.slo of the scale-up")
    assert (status["scrapedPods"], status["failedPods"]) == (1, 2)
    assert any("2 pod(s) unreadable" in e["message"] for e in events(cluster, "mixed"))


async def test_no_data_keeps_replicas_and_reports_metrics_unavailable(fleet: Fleet) -> None:
    cluster = fleet.cluster
    pods = [await fleet.add_pod("dark", "error"), await fleet.add_pod("dark", "garbage")]
    await cluster.create(service("dark", minReplicas=1, maxReplicas=3, replicas=2))
    await cluster.wait_for(lambda: all(len(p.scrapes) >= 4 for p in pods), what="four ticks")
    assert fleet.replicas("dark") == 2 and replica_writes(cluster, "dark") == [2]
    met = await cluster.wait_for(lambda: slo_met(cluster, "dark") if slo_met(cluster, "dark").get("reason") ==
                                 "MetricsUnavailable" else None, what="SLOMet MetricsUnavailable")
    assert met["status"] == "Unknown"


@pytest.mark.parametrize("mode", ["off", "external"])
async def test_off_and_external_never_write_replicas(fleet: Fleet, mode: str) -> None:
    cluster = fleet.cluster
    quiet = await fleet.add_pod("quiet", "slow")
    await cluster.create(service("quiet", mode=mode, replicas=1))
    # A builtin service beside it proves the autoscaler is running and ticking meanwhile.
    busy = await fleet.add_pod("busy", "slow")
    await cluster.create(service("busy"))
    await cluster.wait_for(lambda: fleet.replicas("busy") >= 2 and len(busy.scrapes) >= 4, what="busy scaled")
    assert quiet.scrapes == []  # never scraped
    assert fleet.replicas("quiet") == 1 and replica_writes(cluster, "quiet") == [1]
    assert "slo" not in ((cluster.get(DS, "quiet") or {}).get("status") or {})
    assert events(cluster, "quiet") == []
    if mode == "external":
        # An HPA or KEDA writes spec.replicas through the scale subresource; the Deployment follows it.
        await cluster.patch("/apis/decode.dev/v1alpha1/namespaces/default/decodeservices/quiet/scale",
                            {"spec": {"replicas": 2}})
        assert (cluster.get(DS, "quiet") or {})["spec"]["replicas"] == 2
        await cluster.wait_for(lambda: fleet.replicas("quiet") == 2, what="replicas from the external scaler")
        assert quiet.scrapes == []
    assert cluster.names(PODS)  # the pods were listed from the API, not invented


async def test_switching_to_off_stops_the_autoscaler_and_hands_back_spec_replicas(fleet: Fleet) -> None:
    cluster = fleet.cluster
    switched = await fleet.add_pod("switched", "slow")
    ticker = await fleet.add_pod("ticker", "fast")
    await cluster.create(service("switched"))
    await cluster.create(service("ticker"))
    await cluster.wait_for(lambda: fleet.replicas("switched") >= 2, what="switched scaled up")
    await cluster.patch("/apis/decode.dev/v1alpha1/namespaces/default/decodeservices/switched",
                        {"spec": {"autoscaling": {"mode": "off"}}})
    # mode off: the Deployment gets spec.replicas (1) back from the reconcile, and no tick runs any more.
    await cluster.wait_for(lambda: fleet.replicas("switched") == 1, what="spec.replicas handed back")
    scraped, ticks = len(switched.scrapes), len(ticker.scrapes)
    await cluster.wait_for(lambda: len(ticker.scrapes) >= ticks + 5, what="five ticks of another service")
    assert len(switched.scrapes) <= scraped + 1  # at most the tick that was scraping at the switch
    assert fleet.replicas("switched") == 1


async def test_constant_load_in_the_band_never_moves_replicas(fleet: Fleet) -> None:
    cluster = fleet.cluster
    pods = [await fleet.add_pod("edge", "edge"), await fleet.add_pod("edge", "edge")]
    await cluster.create(service("edge", replicas=2))
    # Eight ticks, several stable windows (1.5 s) and scale-down delays (1 s): no N -> N-1 -> N.
    await cluster.wait_for(lambda: all(len(p.scrapes) >= 8 for p in pods), what="eight ticks")
    assert replica_writes(cluster, "edge") == [2] and events(cluster, "edge") == []
    signal = slo(cluster, "edge").get("signal")
    assert signal is not None and 0.5 <= signal < 0.8, signal


async def test_flapping_metrics_never_reverse_the_replicas(fleet: Fleet) -> None:
    cluster = fleet.cluster
    pod = await fleet.add_pod("flap", "flap")
    await cluster.create(service("flap", maxReplicas=5))
    await cluster.wait_for(lambda: len(pod.scrapes) >= 12, timeout=15, what="twelve ticks")
    writes = replica_writes(cluster, "flap")
    assert writes == sorted(writes) and len(writes) >= 2, writes  # up on a breach, never back down between
    assert not any(e["reason"] == "ScaledDown" for e in events(cluster, "flap"))


async def test_a_restarted_operator_keeps_the_scaled_replicas(cluster: Cluster) -> None:
    # What an earlier operator left: a builtin-mode service whose Deployment it had scaled to 3 while
    # spec.replicas says 1 (stored directly: stopping a first kopf instance mid-tick is not the point here).
    body = service("kept", scaleDownDelaySeconds=300)
    await cluster.create(body)
    children = render(body)
    children.deployment["spec"]["replicas"] = 3
    async with cluster.server.post("/apis/apps/v1/namespaces/default/deployments", json=children.deployment) as resp:
        assert resp.status < 300, await resp.text()
    fleet = Fleet(cluster)
    config = AutoscalingConfig(interval_seconds=INTERVAL, scrape=ScrapeSettings(timeout_seconds=2.0),
                               scrape_overrides=fleet.urls)
    try:
        pod = await fleet.add_pod("kept", "idle")
        async for _ in run_operator(cluster, resync_seconds=0.5, autoscaling=config):
            await cluster.wait_for(lambda: len(pod.scrapes) >= 5, what="five ticks after the restart")
        # The new operator's reconcile read the live replicas instead of resetting them to spec.replicas (1).
        assert 1 not in replica_writes(cluster, "kept") and fleet.replicas("kept") == 3
    finally:
        await fleet.close()
