"""An in-process API server (kmock's KubernetesEmulator) and a kopf operator running against it.

kmock stores objects exactly as posted. A real API server also assigns uid and resourceVersion on
create, sets generation to 1 and bumps it on every spec change; `ApiServer` adds exactly that, so the
operator's observedGeneration and owner references are exercised as they would be on a cluster.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import kmock
import kopf
import pytest
from kmock import KubernetesEmulator, KubernetesError, ResourceInfo, Server, action, resource

from decodeservice.operator.handlers import OperatorConfig, build_registry

DS = "decode.dev/v1alpha1/decodeservices"
DEPLOYMENTS = "apps/v1/deployments"
SERVICES = "v1/services"
CONFIGMAPS = "v1/configmaps"
PDBS = "policy/v1/poddisruptionbudgets"
VERBS = {"list", "watch", "get", "create", "patch", "update", "delete"}


def merge(base: Any, patch: Any) -> Any:
    """RFC 7386 merge patch, as the API server applies `application/merge-patch+json`."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    result = dict(base) if isinstance(base, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge(result.get(key), value)
    return result


class ApiServer(KubernetesEmulator):
    """KubernetesEmulator plus the metadata a real API server maintains (uid, generation, resourceVersion)."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._versions = itertools.count(1)
        self._rejections: list[tuple[action, kmock.resource, int]] = []

    def reject_next(self, verb: action, res: str, status: int) -> None:
        """Answer the next such request with `status` before anything is written (kmock's own reactions
        answer after the emulator stored the write, which models a lost response instead)."""
        self._rejections.append((verb, resource(res), status))

    async def _handle(self, request: kmock.Request) -> Any:
        for rejection in self._rejections:
            verb, res, status = rejection
            if request.action == verb and request.resource == res and request.subresource is None:
                self._rejections.remove(rejection)
                raise KubernetesError(status=status, reason="Injected", message=f"injected {status}")
        data = request.data
        if request.resource is not None and isinstance(data, dict):
            meta = data.setdefault("metadata", {})
            if request.action == action.CREATE:
                meta.setdefault("uid", str(uuid.uuid4()))
                meta.setdefault("generation", 1)
                meta.setdefault("creationTimestamp", datetime.now(tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
                if request.namespace and "namespace" not in meta:
                    meta["namespace"] = request.namespace
            elif request.action == action.UPDATE and request.name is not None:
                key = (request.resource, request.namespace, request.name)
                if key in self.objects and not self.objects[key].deleted:
                    live = self.objects[key].raw
                    new_spec = merge(live.get("spec"), data["spec"]) if "spec" in data else live.get("spec")
                    if request.subresource is None and new_spec != live.get("spec"):
                        meta["generation"] = int(live.get("metadata", {}).get("generation", 1)) + 1
            meta["resourceVersion"] = str(next(self._versions))
        return await super()._handle(request)


def declare_resources(server: KubernetesEmulator) -> None:
    server.resources[DS] = ResourceInfo(kind="DecodeService", singular="decodeservice", namespaced=True,
                                        verbs=VERBS, shortnames={"dsvc"}, subresources={"status", "scale"})
    server.resources[DEPLOYMENTS] = ResourceInfo(kind="Deployment", namespaced=True, verbs=VERBS,
                                                 subresources={"status"})
    server.resources[SERVICES] = ResourceInfo(kind="Service", namespaced=True, verbs=VERBS)
    server.resources[CONFIGMAPS] = ResourceInfo(kind="ConfigMap", namespaced=True, verbs=VERBS)
    server.resources[PDBS] = ResourceInfo(kind="PodDisruptionBudget", namespaced=True, verbs=VERBS)
    server.resources["v1/namespaces"] = ResourceInfo(kind="Namespace", namespaced=False, verbs=VERBS)
    server.resources["apiextensions.k8s.io/v1/customresourcedefinitions"] = ResourceInfo(
        kind="CustomResourceDefinition", namespaced=False, verbs=VERBS)


def fast_settings() -> kopf.OperatorSettings:
    settings = kopf.OperatorSettings()
    settings.watching.server_timeout = 10
    settings.watching.client_timeout = 15
    settings.watching.connect_timeout = 2
    settings.watching.reconnect_backoff = 0.05
    settings.networking.error_backoffs = [0.05, 0.1, 0.2]
    settings.networking.request_timeout = 5
    settings.queueing.idle_timeout = 1.0
    settings.queueing.exit_timeout = 1.0
    settings.posting.enabled = False  # no v1/events in the emulator, and nobody reads them here
    return settings


@dataclass
class Cluster:
    server: ApiServer
    url: str

    def get(self, res: str, name: str, namespace: str = "default") -> dict[str, Any] | None:
        key = (resource(res), namespace, name)  # ObjectsArray lookups need a parsed resource, not a string
        if key not in self.server.objects or self.server.objects[key].deleted:
            return None
        return copy.deepcopy(self.server.objects[key].raw)

    def names(self, res: str) -> list[str]:
        return sorted(name for (key, _, name), obj in self.server.objects.items()
                      if key == resource(res) and not obj.deleted)

    async def create(self, body: Mapping[str, Any], namespace: str = "default") -> None:
        plural = {"DecodeService": "decodeservices"}[str(body["kind"])]
        async with self.server.post(f"/apis/decode.dev/v1alpha1/namespaces/{namespace}/{plural}", json=body) as resp:
            assert resp.status < 300, await resp.text()

    async def patch(self, path: str, body: Mapping[str, Any]) -> None:
        headers = {"Content-Type": "application/merge-patch+json"}
        async with self.server.patch(path, json=body, headers=headers) as resp:
            assert resp.status < 300, await resp.text()

    async def delete(self, path: str) -> None:
        async with self.server.delete(path) as resp:
            assert resp.status < 300, await resp.text()

    async def wait_for(self, predicate: Callable[[], Any], *, timeout: float = 10.0, what: str = "") -> Any:
        """Poll the emulator's in-memory state (no sleeps in tests: a bounded wait on a condition)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if loop.time() > deadline:
                raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
            await asyncio.sleep(0.02)


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    async with ApiServer() as server, Server(server) as http:
        declare_resources(server)
        yield Cluster(server=server, url=str(http.url).rstrip("/"))


async def run_operator(cluster: Cluster, *, resync_seconds: float = 0.3) -> AsyncIterator[None]:
    """Run kopf in its own thread and loop: at exit kopf cancels every other task of its loop."""
    config = OperatorConfig(resync_seconds=resync_seconds, retry_base_seconds=0.05, retry_max_seconds=0.2,
                            request_timeout_seconds=5,
                            connection=kopf.ConnectionInfo(server=cluster.url, insecure=True))
    stop, ready = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def main() -> None:
        try:
            asyncio.run(kopf.operator(registry=build_registry(config), settings=fast_settings(), clusterwide=True,
                                      standalone=True, stop_flag=stop, ready_flag=ready))
        except BaseException as exc:  # reported to the test below, never swallowed
            errors.append(exc)
            ready.set()

    thread = threading.Thread(target=main, name="kopf", daemon=True)
    thread.start()
    try:
        assert await asyncio.to_thread(ready.wait, 10), "kopf did not become ready"
        assert not errors, errors
        yield
    finally:
        stop.set()
        await asyncio.to_thread(thread.join, 20)
        assert not thread.is_alive(), "kopf did not stop"
    assert not errors, errors


@pytest.fixture
async def operator(cluster: Cluster) -> AsyncIterator[Cluster]:
    async for _ in run_operator(cluster):
        yield cluster
