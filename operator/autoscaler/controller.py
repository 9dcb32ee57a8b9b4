"""The builtin autoscaler's I/O loop: one tick per DecodeService every `intervalSeconds`.

A tick reads the Deployment's replicas (a multi-node service's LeaderWorkerSet's, counted in pod groups)
and the serving pods (manifests.serving_selector: a LeaderWorkerSet's leaders), scrapes the ready pods'
proxies, hands a `FleetObservation` to that service's `Autoscaler` (one per uid, kept in memory for
its windows and stabilization), and writes what it decided: the Deployment's replicas when they
change (with an Event saying why), and `status.slo` plus the `SLOMet` condition.

The reconcile asks `replicas_for` what the Deployment should have, so the resync never undoes a
decision: in builtin mode the last decision wins over spec.replicas.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import kopf

from decodeservice.operator.autoscaler.decide import Autoscaler, AutoscalerSettings
from decodeservice.operator.autoscaler.report import same_measurement, scale_event, slo_status
from decodeservice.operator.autoscaler.scrape import ScrapeResult, ScrapeSettings, census, scrape
from decodeservice.operator.autoscaler.types import FleetObservation, ScaleDecision
from decodeservice.operator.autoscaler.zero import IdleClock, RouterSignal, scrape_routers, with_router_signal
from decodeservice.operator.cold_start import cold_start
from decodeservice.operator.errors import ApiError, InvalidSpecError
from decodeservice.operator.kube import KINDS, Kind, KubeClient
from decodeservice.operator.leader_worker_set import multi_node
from decodeservice.operator.manifests import serving_selector
from decodeservice.operator.router import routed, router_selector
from decodeservice.operator.spec import GROUP, PLURAL, VERSION, AutoscalingMode, ValidatedSpec, validate_spec
from decodeservice.operator.status import now_iso, slo_condition, with_condition

DECODESERVICE = Kind(api_version=f"{GROUP}/{VERSION}", plural=PLURAL)
FIELD_MANAGER = "decodeservice-autoscaler"


@dataclass(frozen=True, kw_only=True)
class AutoscalingConfig:
    """Operator-wide autoscaler settings (each DecodeService may set its own intervalSeconds)."""

    interval_seconds: float = 5.0
    scrape: ScrapeSettings = ScrapeSettings()
    # Test-only: pod name -> proxy base URL, for stand-in pods that are loopback servers on ports of
    # their own. Empty in a cluster, where each pod is reached at its IP on the proxy port.
    scrape_overrides: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0.1 <= self.interval_seconds <= 300:
            raise ValueError(f"autoscaling interval_seconds must be within [0.1, 300], got {self.interval_seconds}")


def settings_for(v: ValidatedSpec, *, default_interval: float) -> AutoscalerSettings:
    """The spec's knobs as AutoscalerSettings; knobs left unset keep the decision side's defaults."""
    a, slo = v.spec.autoscaling, v.policy.slo
    optional = {"stable_window_seconds": a.stable_window_seconds, "panic_window_seconds": a.panic_window_seconds,
                "scale_up_threshold": a.scale_up_threshold, "scale_down_threshold": a.scale_down_threshold,
                "kv_usage_threshold": a.kv_usage_threshold, "waiting_threshold": a.waiting_threshold}
    # Typed Any: each value lands on a field of its own type, which mypy cannot see through **.
    overrides: dict[str, Any] = {k: value for k, value in optional.items() if value is not None}
    try:
        return AutoscalerSettings(
            min_replicas=a.min_replicas, max_replicas=a.max_replicas, ttft_seconds=slo.ttft_ms / 1000.0,
            itl_seconds=slo.itl_ms / 1000.0, percentile=slo.percentile,
            interval_seconds=a.interval_seconds or default_interval,
            target_inflight_per_replica=a.target_inflight_per_replica,
            scale_down_stabilization_seconds=float(a.scale_down_delay_seconds), **overrides)
    except ValueError as exc:
        raise InvalidSpecError(f"spec.autoscaling: {exc}") from None


def workload_kind(v: ValidatedSpec) -> Kind:
    """What runs the replicas: a Deployment, or a LeaderWorkerSet whose spec.replicas counts pod groups."""
    return KINDS["LeaderWorkerSet"] if multi_node(v) else KINDS["Deployment"]


def clamp_replicas(v: ValidatedSpec, replicas: int) -> int:
    a = v.spec.autoscaling
    return max(a.min_replicas, min(a.max_replicas, replicas))


@dataclass
class _State:
    autoscaler: Autoscaler
    settings: AutoscalerSettings
    decided: int | None = None  # the last decision's replicas: what the reconcile writes
    last_scale_time: str | None = None
    slo: dict[str, Any] | None = None  # the last status.slo written, fresher than any copy kopf holds
    idle: IdleClock = field(default_factory=lambda: IdleClock(time.time))  # the routers' clock is wall time


@dataclass(frozen=True, kw_only=True)
class TickResult:
    decision: ScaleDecision
    scraped: ScrapeResult
    interval_seconds: float


class Autoscaling:
    """Every builtin-mode DecodeService's autoscaler state, owned by one operator's registry."""

    def __init__(self, config: AutoscalingConfig) -> None:
        self.config = config
        self._states: dict[str, _State] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._closed = False
        self._http: aiohttp.ClientSession | None = None

    def decided(self, uid: str) -> int | None:
        state = self._states.get(uid)
        return None if state is None else state.decided

    def latest_slo(self, uid: str) -> dict[str, Any] | None:
        state = self._states.get(uid)
        return None if state is None else state.slo

    def forget(self, uid: str) -> None:
        self._states.pop(uid, None)
        lock = self._locks.get(uid)
        if lock is not None and not lock.locked():
            del self._locks[uid]

    def lock(self, uid: str) -> asyncio.Lock:
        """Held by a tick from reading the replicas to writing them, and by the reconcile of that service."""
        lock = self._locks.get(uid)
        if lock is None:
            lock = self._locks[uid] = asyncio.Lock()
        return lock

    async def close(self) -> None:
        self._closed = True  # the daemons end on their own instead of ticking against a closed client
        if self._http is not None:
            await self._http.close()
            self._http = None

    async def replicas_for(self, client: KubeClient, v: ValidatedSpec, *, uid: str, name: str,
                           namespace: str) -> int | None:
        """The Deployment's replicas in builtin mode, or None (other modes: spec.replicas as written).

        The last decision wins; before the first one (a new service, or an operator restart) the live
        Deployment's replicas, so a restart does not reset a scaled service to spec.replicas."""
        if v.spec.autoscaling.mode is not AutoscalingMode.BUILTIN:
            return None
        decided = self.decided(uid)
        if decided is None:
            try:
                live = await client.get(workload_kind(v), namespace, name)
            except ApiError as exc:
                if exc.status != 403:
                    raise
                live = None  # no RBAC for a LeaderWorkerSet: its apply fails next and says so (LWSForbidden)
            decided = int((live or {}).get("spec", {}).get("replicas", v.spec.replicas))
        return clamp_replicas(v, decided)

    def _state(self, uid: str, settings: AutoscalerSettings) -> _State:
        state = self._states.get(uid)
        if state is None:
            state = self._states[uid] = _State(autoscaler=Autoscaler(settings), settings=settings)
        elif state.settings != settings:
            state.autoscaler.update_settings(settings)
            state.settings = settings
        return state

    def _session(self) -> aiohttp.ClientSession:
        # Its own session: the API client's carries the operator's credentials, which pods must never see.
        if self._closed:
            raise kopf.TemporaryError("the operator is shutting down")  # no session that nobody would close
        if self._http is None:
            self._http = aiohttp.ClientSession(headers={"User-Agent": "decodeservice-autoscaler"})
        return self._http

    async def run(self, *, uid: str, body: Mapping[str, Any], client: Callable[[], KubeClient],
                  stopped: kopf.DaemonStopped, logger: kopf.Logger) -> None:
        """Tick every interval until kopf stops the daemon or the operator closes this (its cleanup). A
        failed tick is logged (once while the same failure repeats) and the next one tries again: scaling
        must not stop on one bad answer."""
        loop = asyncio.get_running_loop()
        interval, last_warning = self.config.interval_seconds, ""
        try:
            while not stopped and not self._closed:
                started, warning = loop.time(), ""
                try:
                    result = await self.tick(client(), validate_spec(body.get("spec")), body)
                    if result is not None:
                        interval = result.interval_seconds
                        d = result.decision
                        if d.changed:
                            logger.info(f"scaled {d.current_replicas} -> {d.desired_replicas}: {d.reason}")
                        for pod, why in result.scraped.errors.items():
                            logger.debug(f"pod {pod} left out of this decision: {why}")
                except InvalidSpecError as exc:
                    warning = f"not autoscaling an invalid spec: {exc}"  # the reconcile reports it in status
                except (ApiError, kopf.TemporaryError) as exc:
                    warning = f"autoscaler tick failed, retrying every {interval:g}s: {exc}"
                if warning and warning != last_warning:
                    logger.warning(warning)
                last_warning = warning
                # A fixed rate: the tick's own time is part of the interval.
                await stopped.wait(max(0.0, interval - (loop.time() - started)))
        finally:
            self.forget(uid)

    async def tick(self, client: KubeClient, v: ValidatedSpec, body: Mapping[str, Any]) -> TickResult | None:
        """One scrape, one decision, its writes. None when there is no Deployment to scale yet."""
        meta = body.get("metadata") or {}
        name, namespace, uid = str(meta["name"]), str(meta["namespace"]), str(meta["uid"])
        settings = settings_for(v, default_interval=self.config.interval_seconds)
        state = self._state(uid, settings)
        # The serving pods: every pod of a Deployment, the leaders (one per group) of a LeaderWorkerSet.
        listed = await client.list_pods(namespace, serving_selector(name, v))
        pods = census(listed, overrides=self.config.scrape_overrides)
        scraped = await scrape(self._session(), pods.ready, settings=self.config.scrape, clock=time.monotonic)
        signal: RouterSignal | None = None
        if routed(v):  # the routers see demand where no pod is ready to: held requests, the last request
            routers = census(await client.list_pods(namespace, router_selector(name)),
                             overrides=self.config.scrape_overrides)
            signal = await scrape_routers(self._session(), routers.ready, settings=self.config.scrape)
        # Read, decide and write under the service's lock, which the reconcile holds from reading the
        # decision to writing the Deployment: neither can undo the other with a value it read earlier.
        async with self.lock(uid):
            kind = workload_kind(v)
            workload = await client.get(kind, namespace, name)
            mode = ((body.get("spec") or {}).get("autoscaling") or {}).get("mode")
            if workload is None or mode != AutoscalingMode.BUILTIN.value:
                return None  # nothing to scale yet, or the mode left builtin while this tick scraped
            current = int((workload.get("spec") or {}).get("replicas") or 0)
            decision = state.autoscaler.decide(FleetObservation(
                at=time.monotonic(), current_replicas=current, samples=scraped.samples,
                failed_pods=scraped.failed, starting_pods=pods.starting))
            if signal is not None:
                a = v.spec.autoscaling
                decision = with_router_signal(decision, signal=signal, idle_for=state.idle.idle_for(signal),
                                              samples=scraped.samples, min_replicas=a.min_replicas,
                                              max_replicas=a.max_replicas, idle_seconds=float(a.idle_seconds))
            now = now_iso()
            state.decided = decision.desired_replicas
            if decision.changed:
                # Server-side apply of the one field, under a manager of its own: the operator's applies
                # (which carry this same decision) keep owning the rest of the Deployment.
                await client.apply(kind, namespace, name, {
                    "apiVersion": kind.api_version, "kind": workload["kind"],
                    "metadata": {"name": name, "namespace": namespace},
                    "spec": {"replicas": decision.desired_replicas}}, field_manager=FIELD_MANAGER)
                state.last_scale_time = now
        if decision.changed:
            try:
                await client.post_event(namespace, scale_event(decision, name=name, namespace=namespace, uid=uid,
                                                               now=now))
            except ApiError:
                pass  # an Event is a courtesy: without RBAC for events the scaling itself still happened
        await self._write_status(client, body, decision, state=state, now=now, name=name, namespace=namespace,
                                 percentile=v.policy.slo.percentile, cold=cold_start(listed))
        return TickResult(decision=decision, scraped=scraped, interval_seconds=settings.interval_seconds)

    async def _write_status(self, client: KubeClient, body: Mapping[str, Any], decision: ScaleDecision, *,
                            state: _State, now: str, name: str, namespace: str, percentile: float,
                            cold: dict[str, Any] | None) -> None:
        live: Mapping[str, Any] = body.get("status") or {}
        if state.last_scale_time is None and isinstance(live.get("slo"), Mapping):
            state.last_scale_time = live["slo"].get("lastScaleTime")  # survives an operator restart
        slo = state.slo = slo_status(decision, observed_time=now, last_scale_time=state.last_scale_time)
        generation = int((body.get("metadata") or {}).get("generation") or 0)
        met = slo_condition(slo, percentile)
        before: Mapping[str, Any] = next((c for c in live.get("conditions") or [] if c.get("type") == "SLOMet"), {})
        patch: dict[str, Any] = {}
        if not same_measurement(slo, live.get("slo")):
            patch["slo"] = slo
        if cold is not None and cold != live.get("coldStart"):
            patch["coldStart"] = cold
        # The conditions list is written whole, so only when SLOMet changes status or reason: the other
        # conditions in this copy may be older than the reconcile's last write (which also refreshes
        # SLOMet's message from the latest figures).
        if (before.get("status"), before.get("reason")) != met[:2]:
            patch["conditions"] = with_condition(live, "SLOMet", met, generation=generation, now=now)
        if patch:  # nothing new: no write, no watch event for every tick of an idle service
            await client.patch_status(DECODESERVICE, namespace, name, {"status": patch})
