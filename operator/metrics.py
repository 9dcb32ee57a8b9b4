"""The operator's own /metrics: gauges read from each DecodeService's status, for dashboards and alerts.

- `decodeservice_replicas{namespace,name,state}`: `desired` (the builtin autoscaler's decision when it
  has one, else the spec's replicas within the autoscaling bounds), `current` and `ready` (status);
- `decodeservice_autoscaler_signal{namespace,name}`: `status.slo.signal` (builtin autoscaling only);
- `decodeservice_cold_start_seconds{namespace,name}`: `status.coldStart.lastSeconds`, once measured.

A kopf event handler keeps the latest figures of every DecodeService the operator watches in a
`StatusStore`; the collector renders them at scrape time, so a scrape never calls the API.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import kopf
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from decodeservice.operator.errors import InvalidSpecError
from decodeservice.operator.manifests import desired_replicas
from decodeservice.operator.spec import GROUP, PLURAL, VERSION, AutoscalingMode, validate_spec

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ServiceFigures:
    namespace: str
    name: str
    desired: int | None  # None: the spec is invalid, so nothing is wanted of it
    current: int
    ready: int
    signal: float | None
    cold_start_seconds: float | None


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def figures(body: Mapping[str, Any]) -> ServiceFigures:
    """What one DecodeService object says (pure: the object in, figures out)."""
    meta = body.get("metadata") or {}
    status = body.get("status") or {}
    slo = status.get("slo") or {}
    desired: int | None
    try:
        v = validate_spec(body.get("spec"))
    except InvalidSpecError:
        desired = None
    else:
        decided = _number(slo.get("desiredReplicas"))
        builtin = v.spec.autoscaling.mode is AutoscalingMode.BUILTIN
        desired = int(decided) if builtin and decided is not None else desired_replicas(v)
    return ServiceFigures(
        namespace=str(meta.get("namespace") or ""), name=str(meta.get("name") or ""), desired=desired,
        current=int(_number(status.get("replicas")) or 0), ready=int(_number(status.get("readyReplicas")) or 0),
        signal=_number(slo.get("signal")), cold_start_seconds=_number((status.get("coldStart") or {}).get("lastSeconds")))


class StatusStore:
    """The latest figures per DecodeService, fed by watch events (kopf's `on.event`)."""

    def __init__(self) -> None:
        self._services: dict[tuple[str, str], ServiceFigures] = {}

    def observe(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        current = figures(body)
        key = (current.namespace, current.name)
        if event_type == "DELETED":
            self._services.pop(key, None)
        else:
            self._services[key] = current

    def services(self) -> list[ServiceFigures]:
        return [self._services[k] for k in sorted(self._services)]


class StatusCollector(Collector):
    def __init__(self, store: StatusStore) -> None:
        self._store = store

    def collect(self) -> Iterator[GaugeMetricFamily]:
        replicas = GaugeMetricFamily("decodeservice_replicas", "Replicas of each DecodeService by state: "
                                     "desired, current, ready.", labels=["namespace", "name", "state"])
        signal = GaugeMetricFamily("decodeservice_autoscaler_signal", "The builtin autoscaler's latest signal "
                                   "(status.slo.signal; above 1 it scales up).", labels=["namespace", "name"])
        cold = GaugeMetricFamily("decodeservice_cold_start_seconds", "Pod creation to Ready of the latest new "
                                 "replicas (status.coldStart.lastSeconds).", labels=["namespace", "name"])
        for s in self._store.services():
            if s.desired is not None:
                replicas.add_metric([s.namespace, s.name, "desired"], s.desired)
            replicas.add_metric([s.namespace, s.name, "current"], s.current)
            replicas.add_metric([s.namespace, s.name, "ready"], s.ready)
            if s.signal is not None:
                signal.add_metric([s.namespace, s.name], s.signal)
            if s.cold_start_seconds is not None:
                cold.add_metric([s.namespace, s.name], s.cold_start_seconds)
        yield from (replicas, signal, cold)


def metrics_app(store: StatusStore) -> web.Application:
    """GET /metrics over the store (aiohttp, which kopf already runs on)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatusCollector(store))

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    return app


def install(registry: kopf.OperatorRegistry, *, host: str, port: int) -> StatusStore:
    """Add the status watch and the /metrics server to an operator's registry."""
    store = StatusStore()
    runner: list[web.AppRunner] = []

    # Async on purpose: kopf runs sync handlers in worker threads, and the store is read by /metrics on
    # the event loop; both on the loop, neither sees the other's dict half-changed.
    @kopf.on.event(GROUP, VERSION, PLURAL, registry=registry)
    async def observe(event: kopf.RawEvent, body: kopf.Body, **_: Any) -> None:
        store.observe(str(event.get("type") or ""), body)

    @kopf.on.startup(registry=registry)
    async def start_metrics(**_: Any) -> None:
        app_runner = web.AppRunner(metrics_app(store), access_log=None)
        await app_runner.setup()
        await web.TCPSite(app_runner, host, port).start()
        runner.append(app_runner)

    @kopf.on.cleanup(registry=registry)
    async def stop_metrics(**_: Any) -> None:
        while runner:
            await runner.pop().cleanup()

    return store
