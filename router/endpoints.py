"""Where the endpoints come from: a static list (`--endpoints`), or the EndpointSlices of a Service
(`--service`), watched with the official `kubernetes` client from inside the cluster.

The pods' Service (`<name>-pods`) labels its EndpointSlices `kubernetes.io/service-name=<name>-pods`;
an endpoint is routed to while its `conditions.ready` is true (a draining pod's proxy answers /ready
503, so Kubernetes marks it unready before it stops). The client is synchronous, so the watch runs in a
thread and hands each new set to the event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

log = logging.getLogger(__name__)
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
WATCH_TIMEOUT_S = 60  # a watch is renewed this often, so a stopped router's thread ends within it
RETRY_S = 2.0

Publish = Callable[[dict[str, bool | None]], None]


class EndpointSource(Protocol):
    async def run(self, publish: Publish) -> None:
        """Publish the endpoint set whenever it changes; runs until cancelled."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StaticEndpoints:
    urls: tuple[str, ...]

    async def run(self, publish: Publish) -> None:
        publish({url.rstrip("/"): None for url in self.urls})  # readiness: probed by the fleet


def slice_endpoints(endpoint_slice: Mapping[str, Any], *, port: int) -> dict[str, bool]:
    """`http://<address>:<port> -> ready` for one EndpointSlice (as a JSON mapping). An endpoint
    without `conditions.ready` counts as ready, as the EndpointSlice API defines."""
    family = endpoint_slice.get("addressType", "IPv4")
    out: dict[str, bool] = {}
    for endpoint in endpoint_slice.get("endpoints") or ():
        conditions = endpoint.get("conditions") or {}
        ready = conditions.get("ready")
        for address in endpoint.get("addresses") or ():
            host = f"[{address}]" if family == "IPv6" else address
            out[f"http://{host}:{port}"] = ready is None or bool(ready)
    return out


def merge_slices(slices: Iterable[Mapping[str, Any]], *, port: int) -> dict[str, bool | None]:
    """The union of every slice's endpoints; an address in two slices is ready if either says so."""
    merged: dict[str, bool | None] = {}
    for endpoint_slice in slices:
        for url, ready in slice_endpoints(endpoint_slice, port=port).items():
            merged[url] = bool(merged.get(url)) or ready
    return merged


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class EndpointSliceWatch:
    service: str
    namespace: str
    port: int
    # Builds the `kubernetes` ApiClient; None: from the pod's in-cluster config (tests pass one for the
    # API emulator).
    api_client: Callable[[], Any] | None = None
    watch_timeout_s: int = WATCH_TIMEOUT_S
    # A read that waits longer than this ends the watch and the slices are listed again. Beyond the
    # server's own `timeoutSeconds` in a cluster; short in tests, so that a stopped watch's thread ends.
    read_timeout_s: float = WATCH_TIMEOUT_S + 10

    @staticmethod
    def check_config() -> None:
        """Raise (the client's ConfigException) unless this process runs in a pod with a service account."""
        import kubernetes

        k8s: Any = kubernetes
        k8s.config.load_incluster_config()

    async def run(self, publish: Publish) -> None:
        loop = asyncio.get_running_loop()
        stop = threading.Event()

        def hand_over(endpoints: dict[str, bool | None]) -> None:
            if not stop.is_set():
                loop.call_soon_threadsafe(publish, endpoints)

        thread = threading.Thread(target=self._watch, args=(hand_over, stop), name="endpointslice-watch",
                                  daemon=True)
        thread.start()
        try:
            await asyncio.Event().wait()  # until cancelled
        finally:
            stop.set()

    def _client(self) -> Any:
        import kubernetes

        k8s: Any = kubernetes
        if self.api_client is not None:
            return self.api_client()
        k8s.config.load_incluster_config()  # checked by the CLI before the server started
        return k8s.client.ApiClient()

    def _watch(self, publish: Publish, stop: threading.Event) -> None:
        import kubernetes
        import urllib3

        # The client's models type every field Optional and its helpers are untyped: read it as Any.
        k8s: Any = kubernetes
        client = self._client()
        api = k8s.client.DiscoveryV1Api(client)
        serialize = client.sanitize_for_serialization
        selector = f"{SERVICE_NAME_LABEL}={self.service}"
        while not stop.is_set():
            try:
                listed = api.list_namespaced_endpoint_slice(self.namespace, label_selector=selector,
                                                            _request_timeout=self.read_timeout_s)
                slices = {s.metadata.name: serialize(s) for s in listed.items}
                publish(merge_slices(slices.values(), port=self.port))
                stream = k8s.watch.Watch().stream(
                    api.list_namespaced_endpoint_slice, self.namespace, label_selector=selector,
                    resource_version=listed.metadata.resource_version, timeout_seconds=self.watch_timeout_s,
                    _request_timeout=self.read_timeout_s)
                for event in stream:
                    obj = event["object"]
                    name = obj.metadata.name
                    if event["type"] == "DELETED":
                        slices.pop(name, None)
                    else:
                        slices[name] = serialize(obj)
                    publish(merge_slices(slices.values(), port=self.port))
                    if stop.is_set():
                        return
            except (urllib3.exceptions.ReadTimeoutError, urllib3.exceptions.ProtocolError):
                continue  # a quiet watch (or one the server closed): list again and watch on
            except Exception as exc:  # API errors, an expired resourceVersion (410): list again
                log.warning("EndpointSlice watch for %s/%s failed (%s); retrying", self.namespace,
                            self.service, exc)
                stop.wait(RETRY_S)
