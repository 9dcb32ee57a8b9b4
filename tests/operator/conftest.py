"""An in-process API server (`decodeservice.loadgen.kube_emulator`) and a kopf operator running against it."""

from __future__ import annotations

import asyncio
import copy
import threading
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import kopf
import pytest
from kmock import Server, resource

from decodeservice.operator.autoscaler.controller import AutoscalingConfig
from decodeservice.operator.handlers import OperatorConfig, build_registry
from decodeservice.operator.metrics import install as install_metrics
from tests.support.kube_emulator import ApiServer, declare_resources


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
    settings.posting.enabled = False  # kopf's own log-line Events: nobody reads them here
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


async def run_operator(cluster: Cluster, *, resync_seconds: float = 0.3, namespaces: Sequence[str] = (),
                       autoscaling: AutoscalingConfig | None = None,
                       metrics_port: int | None = None) -> AsyncIterator[None]:
    """Run kopf in its own thread and loop: at exit kopf cancels every other task of its loop.

    With `namespaces` it watches only those (names or globs), as `decodectl operator -n NS` does; with
    `metrics_port` it serves its /metrics there, as `decodectl operator --metrics URL` does."""
    config = OperatorConfig(resync_seconds=resync_seconds, retry_base_seconds=0.05, retry_max_seconds=0.2,
                            request_timeout_seconds=5, autoscaling=autoscaling or AutoscalingConfig(),
                            connection=kopf.ConnectionInfo(server=cluster.url, insecure=True))
    registry = build_registry(config)
    if metrics_port is not None:
        install_metrics(registry, host="127.0.0.1", port=metrics_port)
    stop, ready = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def main() -> None:
        try:
            asyncio.run(kopf.operator(registry=registry, settings=fast_settings(),
                                      clusterwide=not namespaces, namespaces=list(namespaces),
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
