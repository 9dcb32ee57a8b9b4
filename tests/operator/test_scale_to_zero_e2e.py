"""Scale to zero and back, end to end: kopf against the API emulator, routers and pods played by loopback
HTTP servers.

Each stand-in router serves `/metrics` through the router's own `RouterMetrics`
(`decode_router:requests_held{class}`, `decode_router:last_request_timestamp_seconds`) at values the test
sets; each stand-in engine pod serves the proxy's real `ProxyMetrics` with no traffic. A small stand-in for
the Deployment controller creates pod objects to follow the Deployment's replicas; they start unready (a
pending replica) until the test marks them Ready, as a kubelet would, with the creation and Ready times
status.coldStart is measured from.
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
from kmock import action

from decodeservice.operator.autoscaler.controller import AutoscalingConfig
from decodeservice.operator.autoscaler.scrape import ScrapeSettings
from decodeservice.operator.manifests import selector_labels
from decodeservice.operator.router import router_selector
from decodeservice.proxy.metrics import ProxyMetrics
from decodeservice.proxy.policy import Policy
from decodeservice.router.metrics import RouterMetrics
from tests.operator.conftest import Cluster, run_operator
from tests.operator.helpers import EXAMPLES
from tests.support.kube_emulator import (
    DEPLOYMENTS,
    DS,
    EVENTS,
    PDBS,
    ROLE_BINDINGS,
    ROLES,
    SERVICE_ACCOUNTS,
    SERVICES,
)

INTERVAL = 0.3
CREATED = "2026-01-01T00:00:00Z"
READY_AT = "2026-01-01T00:00:42Z"  # a 42 s cold start, as the kubelet would have recorded it


@dataclass
class Stand:
    """One loopback server standing in for a pod: its name and how often it was scraped."""

    name: str
    runner: web.AppRunner
    scrapes: int = 0


@dataclass
class World:
    cluster: Cluster
    urls: dict[str, str] = field(default_factory=dict)  # the operator's scrape_overrides (a live view)
    held: float = 0.0
    last_request: float = 0.0
    routers: list[Stand] = field(default_factory=list)
    pods: list[Stand] = field(default_factory=list)

    async def _serve(self, name: str, body: Any) -> Stand:
        stand: Stand | None = None

        async def metrics(_: web.Request) -> web.Response:
            assert stand is not None
            stand.scrapes += 1
            return web.Response(text=body(), content_type="text/plain")

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        stand = Stand(name=name, runner=runner)
        self.urls[name] = f"http://127.0.0.1:{runner.addresses[0][1]}"
        return stand

    def router_metrics(self) -> str:
        """The router's own exposition (decodeservice.router.metrics), at the values the test set."""
        metrics = RouterMetrics()
        metrics.held.labels("interactive").set(self.held)
        metrics.last_request.set(self.last_request)
        return metrics.render(ready=0, known=0).decode()

    async def add_router(self, service: str) -> Stand:
        stand = await self._serve(f"{service}-router-{len(self.routers)}", self.router_metrics)
        self.routers.append(stand)
        await self._create_pod(stand.name, router_selector(service), ready=True)
        return stand

    async def _create_pod(self, name: str, labels: dict[str, str], *, ready: bool) -> None:
        body = {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "namespace": "default", "labels": labels, "creationTimestamp": CREATED},
                "status": {"phase": "Running" if ready else "Pending", "podIP": "127.0.0.1",
                           "conditions": [{"type": "Ready", "status": "True" if ready else "False",
                                           "lastTransitionTime": READY_AT if ready else CREATED}]}}
        async with self.cluster.server.post("/api/v1/namespaces/default/pods", json=body) as resp:
            assert resp.status < 300, await resp.text()

    async def mark_ready(self, pod: Stand) -> None:
        await self.cluster.patch(f"/api/v1/namespaces/default/pods/{pod.name}", {"status": {
            "phase": "Running", "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": READY_AT}]}})

    def replicas(self, service: str) -> int:
        return int(((self.cluster.get(DEPLOYMENTS, service) or {}).get("spec") or {}).get("replicas") or 0)

    async def follow(self, service: str) -> None:
        """The Deployment controller's part: new pods start unready; extra ones go."""
        policy = Policy.model_validate({})
        seq = 0
        while True:
            want = self.replicas(service)
            if len(self.pods) < want:
                seq += 1
                metrics = ProxyMetrics(policy)
                stand = await self._serve(f"{service}-{seq}", lambda m=metrics: m.render().decode())
                self.pods.append(stand)
                await self._create_pod(stand.name, selector_labels(service), ready=False)
            elif len(self.pods) > want:
                stand = self.pods.pop()
                await self.cluster.delete(f"/api/v1/namespaces/default/pods/{stand.name}")
                self.urls.pop(stand.name, None)
                await stand.runner.cleanup()
            else:
                await asyncio.sleep(0.02)

    async def close(self) -> None:
        for stand in [*self.routers, *self.pods]:
            await stand.runner.cleanup()


@pytest.fixture
async def world(cluster: Cluster) -> AsyncIterator[World]:
    world = World(cluster)
    config = AutoscalingConfig(interval_seconds=INTERVAL, scrape=ScrapeSettings(timeout_seconds=2.0),
                               scrape_overrides=world.urls)
    try:
        async for _ in run_operator(cluster, resync_seconds=0.5, autoscaling=config):
            yield world
    finally:
        await world.close()


def service(name: str) -> dict[str, Any]:
    body = copy.deepcopy(yaml.safe_load((EXAMPLES / "scale-to-zero.yaml").read_text()))
    body["metadata"]["name"] = name
    body["spec"]["replicas"] = 0
    body["spec"]["autoscaling"].update(intervalSeconds=INTERVAL, stableWindowSeconds=1.5, panicWindowSeconds=0.6,
                                       scaleDownDelaySeconds=1, idleSeconds=1)
    return body


def status(cluster: Cluster, name: str) -> dict[str, Any]:
    return dict((cluster.get(DS, name) or {}).get("status") or {})


def events(cluster: Cluster, name: str) -> list[str]:
    found = [cluster.get(EVENTS, e) for e in cluster.names(EVENTS)]
    return [e["message"] for e in found if e and e["involvedObject"]["name"] == name]


async def test_held_requests_scale_from_zero_and_idling_scales_back_to_zero(world: World) -> None:
    cluster = world.cluster
    follower = asyncio.create_task(world.follow("lazy"))
    try:
        router = await world.add_router("lazy")
        await cluster.create(service("lazy"))
        await cluster.wait_for(lambda: cluster.get(DEPLOYMENTS, "lazy") and router.scrapes >= 4,
                               what="four ticks at zero")
        assert world.replicas("lazy") == 0 and world.pods == []
        ready = next(c for c in status(cluster, "lazy")["conditions"] if c["type"] == "Ready")
        assert (ready["status"], ready["reason"]) == ("True", "ScaledToZero")  # the router holds: not an outage

        # A request arrives: the router holds it and says so; one replica starts on the next tick.
        world.held, world.last_request = 2, time.time()
        seen = router.scrapes
        await cluster.wait_for(lambda: world.replicas("lazy") == 1, what="0 -> 1 on the held requests")
        assert router.scrapes <= seen + 2  # the tick that read it, or the one after: no window waited for
        await cluster.wait_for(lambda: any("scale from zero" in m and "2 request(s) held" in m
                                           for m in events(cluster, "lazy")), what="the ScaledUp Event")

        # The replica is pending and the requests are still held: it is capacity on its way, not missing.
        await cluster.wait_for(lambda: len(world.pods) == 1, what="the pending pod")
        seen = router.scrapes
        await cluster.wait_for(lambda: router.scrapes >= seen + 5, what="five ticks with a pending replica")
        assert world.replicas("lazy") == 1

        # Ready: the router routes the held requests; its cold start shows in the status.
        await world.mark_ready(world.pods[0])
        world.held, world.last_request = 0, time.time()
        cold = await cluster.wait_for(lambda: status(cluster, "lazy").get("coldStart"), what="status.coldStart")
        assert cold == {"lastSeconds": 42.0, "replicas": 1}
        assert world.pods[0].scrapes > 0  # its proxy is scraped once it is Ready

        # No request for idleSeconds (1 s), none held, none in flight: back to zero.
        last = world.last_request = time.time()
        await cluster.wait_for(lambda: world.replicas("lazy") == 0, timeout=15, what="scale to zero")
        assert time.time() - last >= 1.0
        await cluster.wait_for(lambda: any("scaled to zero" in m for m in events(cluster, "lazy")),
                               what="the ScaledDown Event")
        await cluster.wait_for(lambda: status(cluster, "lazy")["slo"].get("desiredReplicas") == 0,
                               what="status.slo of the scale to zero")
    finally:
        if follower.done():
            follower.result()  # the stand-in controller died: show why
        follower.cancel()


async def test_without_routers_read_nothing_scales_to_zero(world: World) -> None:
    cluster = world.cluster
    follower = asyncio.create_task(world.follow("dark"))
    try:
        body = service("dark")
        body["spec"]["replicas"] = 1
        await cluster.create(body)
        await cluster.wait_for(lambda: len(world.pods) == 1, what="the first pod")
        pod = world.pods[0]
        await world.mark_ready(pod)
        # No router pod answers: idle time cannot be known, so the replica stays however long it waits.
        await cluster.wait_for(lambda: pod.scrapes >= 8, what="eight ticks without a router")
        assert world.replicas("dark") == 1
    finally:
        if follower.done():
            follower.result()
        follower.cancel()


async def test_leaving_router_mode_removes_the_routers_children(operator: Cluster) -> None:
    cluster = operator
    body = service("switch")
    body["spec"]["replicas"] = 1
    body["spec"]["autoscaling"].update(mode="external", minReplicas=1)  # no autoscaler needed here
    await cluster.create(body)
    names = [(DEPLOYMENTS, "switch-router"), (SERVICES, "switch-pods"), (PDBS, "switch-router"),
             (SERVICE_ACCOUNTS, "switch-router"), (ROLES, "switch-router"), (ROLE_BINDINGS, "switch-router")]
    await cluster.wait_for(lambda: all(cluster.get(res, name) for res, name in names), what="the router's children")
    # Applied after the routers, so that it selects them only once they exist.
    svc = await cluster.wait_for(lambda: cluster.get(SERVICES, "switch"), what="the Service")
    assert svc["spec"]["selector"] == router_selector("switch")
    await cluster.patch("/apis/decode.dev/v1alpha1/namespaces/default/decodeservices/switch",
                        {"spec": {"routing": {"mode": "service"}}})
    await cluster.wait_for(lambda: not any(cluster.get(res, name) for res, name in names),
                           what="the router's children deleted")
    # The Service was pointed back at the pods before the routers went.
    assert (cluster.get(SERVICES, "switch") or {})["spec"]["selector"] == selector_labels("switch")


async def test_an_operator_without_the_routers_rbac_says_so_and_retries(operator: Cluster) -> None:
    cluster = operator
    for _ in range(1000):  # every read of a ServiceAccount is forbidden, as with a chart from before the router
        cluster.server.reject_next(action.FETCH, SERVICE_ACCOUNTS, 403)
    body = service("old-chart")
    body["spec"]["autoscaling"].update(mode="external", minReplicas=1)
    await cluster.create(body)

    def ready() -> dict[str, Any]:
        return next((c for c in status(cluster, "old-chart").get("conditions") or [] if c["type"] == "Ready"), {})

    await cluster.wait_for(lambda: ready().get("reason") == "RouterForbidden", what="Ready=False RouterForbidden")
    assert ready()["status"] == "False" and "upgrade the chart" in ready()["message"]
    assert cluster.get(DEPLOYMENTS, "old-chart-router") is None
    assert cluster.get(SERVICES, "old-chart") is None  # never pointed at routers that cannot exist
    cluster.server.clear_rejections()  # the chart is upgraded: the next retry goes through
    await cluster.wait_for(lambda: cluster.get(DEPLOYMENTS, "old-chart-router") and cluster.get(SERVICES, "old-chart"),
                           what="the router applied after the upgrade")
    await cluster.wait_for(lambda: ready().get("reason") != "RouterForbidden", what="RouterForbidden cleared")
