"""The router's cluster mode against the API emulator: EndpointSlices created, updated and deleted there
change the fleet's endpoints (router/endpoints.py's watch, through the official `kubernetes` client).
Every wait is bounded; the watch's reads time out after a second, so its thread ends soon after the
router stops."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from kmock import Server

from decodeservice.router.endpoints import SERVICE_NAME_LABEL, EndpointSliceWatch
from decodeservice.router.fleet import Fleet
from decodeservice.router.prefix_index import PrefixIndex
from tests.router.conftest import wait_until
from tests.support.endpoint_slices import SelectingApiServer, declare_endpoint_slices
from tests.support.kube_emulator import declare_resources

NS = "prod"
SLICES = f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices"


def endpoint_slice(name: str, service: str, *endpoints: tuple[str, bool]) -> dict[str, Any]:
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": name, "namespace": NS, "labels": {SERVICE_NAME_LABEL: service}},
            "addressType": "IPv4", "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}],
            "endpoints": [{"addresses": [ip], "conditions": {"ready": ready}} for ip, ready in endpoints]}


def api_client(url: str) -> Any:
    import kubernetes

    k8s: Any = kubernetes
    configuration = k8s.client.Configuration()
    configuration.host = url
    return k8s.client.ApiClient(configuration)


def watch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "endpointslice-watch"]


@contextlib.asynccontextmanager
async def watching(url: str, fleet: Fleet) -> AsyncIterator[None]:
    watch = EndpointSliceWatch(service="chat-pods", namespace=NS, port=8000, api_client=lambda: api_client(url),
                               watch_timeout_s=5, read_timeout_s=1.0)
    task = asyncio.create_task(watch.run(fleet.update))
    try:
        yield
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # Bounded: the thread's read times out within a second of the stop and it returns; only then
        # can the emulator close without waiting on the watch's open connection.
        deadline = time.monotonic() + 5
        while watch_threads() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert not watch_threads()


@pytest.mark.timeout(60)
async def test_slices_created_updated_and_deleted_in_the_emulator_change_the_routers_endpoints() -> None:
    async with asyncio.timeout(45), SelectingApiServer() as server, Server(server) as http:
        declare_resources(server)
        declare_endpoint_slices(server)
        url = str(http.url).rstrip("/")
        fleet = Fleet(index=PrefixIndex(max_blocks_per_endpoint=64), scrape_interval_s=1.0)
        async with httpx.AsyncClient(base_url=url, timeout=5.0) as k:
            created = await k.post(SLICES, json=endpoint_slice("chat-pods-a", "chat-pods", ("10.0.0.1", True),
                                                                 ("10.0.0.2", False)))
            assert created.status_code < 300, created.text
            # Another Service's slice in the same namespace: the label selector keeps it out.
            other = await k.post(SLICES, json=endpoint_slice("other-pods-a", "other-pods", ("10.0.9.9", True)))
            assert other.status_code < 300, other.text
            async with watching(url, fleet):
                await wait_until(lambda: set(fleet.endpoints) == {"http://10.0.0.1:8000", "http://10.0.0.2:8000"},
                                 timeout=10)
                assert fleet.ready_urls() == ["http://10.0.0.1:8000"]  # ready=false is known, not routed to

                # The second pod turns ready, and a second slice adds a third pod.
                patched = await k.patch(f"{SLICES}/chat-pods-a", headers={"Content-Type": "application/merge-patch+json"},
                                        json={"endpoints": [{"addresses": ["10.0.0.1"], "conditions": {"ready": True}},
                                                            {"addresses": ["10.0.0.2"], "conditions": {"ready": True}}]})
                assert patched.status_code < 300, patched.text
                await wait_until(lambda: sorted(fleet.ready_urls()) == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"],
                                 timeout=10)
                added = await k.post(SLICES, json=endpoint_slice("chat-pods-b", "chat-pods", ("10.0.0.3", True)))
                assert added.status_code < 300, added.text
                await wait_until(lambda: "http://10.0.0.3:8000" in fleet.ready_urls(), timeout=10)

                # The first slice goes: its pods leave the fleet (and their prefix indexes with them).
                deleted = await k.delete(f"{SLICES}/chat-pods-a")
                assert deleted.status_code < 300, deleted.text
                await wait_until(lambda: set(fleet.endpoints) == {"http://10.0.0.3:8000"}, timeout=10)
                assert "http://10.0.9.9:8000" not in fleet.endpoints
