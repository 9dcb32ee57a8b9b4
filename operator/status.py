"""DecodeService status, derived from the children's status (the Deployment's, or a multi-node service's
LeaderWorkerSet's): pure functions, no API calls.

Each condition carries observedGeneration; lastTransitionTime only moves when the status value changes,
so a resync that finds nothing new leaves the timestamps alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from decodeservice.operator.engines import PROXY_PORT
from decodeservice.operator.manifests import selector_labels

CONDITION_TYPES = ("Ready", "Progressing", "Degraded", "SLOMet")


def now_iso() -> str:
    return datetime.now(tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _previous(previous: Mapping[str, Any] | None) -> dict[str, Mapping[str, Any]]:
    conditions = (previous or {}).get("conditions") or []
    return {c["type"]: c for c in conditions if isinstance(c, Mapping) and "type" in c}


def _conditions(values: list[tuple[str, str, str, str]], *, generation: int, previous: Mapping[str, Any] | None,
                now: str) -> list[dict[str, Any]]:
    old = _previous(previous)
    result = []
    for kind, status, reason, message in values:
        before = old.get(kind)
        changed = before is None or before.get("status") != status or "lastTransitionTime" not in before
        result.append({"type": kind, "status": status, "reason": reason, "message": message,
                       "lastTransitionTime": now if changed or before is None else before["lastTransitionTime"],
                       "observedGeneration": generation})
    return result


def _selector(labels: Mapping[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in labels.items())


def invalid_status(*, name: str, generation: int, reason: str, message: str,
                   previous: Mapping[str, Any] | None, now: str | None = None,
                   progress: str = "not reconciled until the spec is fixed") -> dict[str, Any]:
    """Status of a DecodeService whose spec cannot be served: Ready=False with the reason, nothing rolled."""
    values = [("Ready", "False", reason, message),
              ("Progressing", "False", reason, progress),
              ("Degraded", "True", reason, message),
              ("SLOMet", "Unknown", "NoMeasurements", "no pods are serving")]
    prev = previous or {}
    # The last selector stays (an HPA keeps counting the pods it counted); the spec's own may be unreadable.
    return {"observedGeneration": generation, "replicas": int(prev.get("replicas") or 0),
            "readyReplicas": int(prev.get("readyReplicas") or 0),
            "selector": str(prev.get("selector") or _selector(selector_labels(name))),
            "conditions": _conditions(values, generation=generation, previous=previous, now=now or now_iso())}


def _condition(obj: Mapping[str, Any], kind: str) -> Mapping[str, Any]:
    for cond in (obj.get("status") or {}).get("conditions") or []:
        if isinstance(cond, Mapping) and cond.get("type") == kind:
            return cond
    return {}


@dataclass(frozen=True, kw_only=True)
class WorkloadState:
    """What the Deployment or the LeaderWorkerSet reports, in the terms the conditions need."""

    kind: str
    exists: bool
    replicas: int = 0
    ready: int = 0
    updated: int = 0
    stale: bool = False  # its controller has not seen the latest spec yet
    available: bool = True  # the controller's own verdict (LWS: Available), where it has one
    degraded: tuple[str, str, str] = ("False", "AsExpected", "no failures reported")


def deployment_state(deployment: Mapping[str, Any] | None) -> WorkloadState:
    if deployment is None:
        return WorkloadState(kind="Deployment", exists=False)
    status: Mapping[str, Any] = deployment.get("status") or {}
    meta: Mapping[str, Any] = deployment.get("metadata") or {}
    progress = _condition(deployment, "Progressing")
    failure = _condition(deployment, "ReplicaFailure")
    degraded: tuple[str, str, str] = ("False", "AsExpected", "no failures reported")
    if progress.get("reason") == "ProgressDeadlineExceeded":
        degraded = ("True", "ProgressDeadlineExceeded", str(progress.get("message") or "rollout stalled"))
    elif failure.get("status") == "True":
        degraded = ("True", str(failure.get("reason") or "ReplicaFailure"), str(failure.get("message") or ""))
    return WorkloadState(
        kind="Deployment", exists=True, replicas=int(status.get("replicas") or 0),
        ready=int(status.get("readyReplicas") or 0), updated=int(status.get("updatedReplicas") or 0),
        # A Deployment controller that has not seen the latest template yet means the rollout has not begun.
        stale=int(status.get("observedGeneration") or 0) < int(meta.get("generation") or 0), degraded=degraded)


def leader_worker_set_state(lws: Mapping[str, Any] | None) -> WorkloadState:
    """LWS api/leaderworkerset/v1 LeaderWorkerSetStatus: replicas, readyReplicas and updatedReplicas count
    groups; Available (all groups ready and updated) and Progressing/UpdateInProgress exclude each other.
    status.observedGeneration exists from LWS 0.9; before it, the conditions' observedGeneration tells."""
    if lws is None:
        return WorkloadState(kind="LeaderWorkerSet", exists=False)
    status: Mapping[str, Any] = lws.get("status") or {}
    generation = int((lws.get("metadata") or {}).get("generation") or 0)
    available = _condition(lws, "Available")
    seen = status.get("observedGeneration")
    if seen is None:
        seen = max((int(c.get("observedGeneration") or 0) for c in status.get("conditions") or []
                    if isinstance(c, Mapping)), default=0)
    return WorkloadState(
        kind="LeaderWorkerSet", exists=True, replicas=int(status.get("replicas") or 0),
        ready=int(status.get("readyReplicas") or 0), updated=int(status.get("updatedReplicas") or 0),
        stale=int(seen) < generation, available=available.get("status") == "True")


def workload_state(workload: Mapping[str, Any] | None, *, kind: str) -> WorkloadState:
    return leader_worker_set_state(workload) if kind == "LeaderWorkerSet" else deployment_state(workload)


def slo_condition(slo: Mapping[str, Any], percentile: float) -> tuple[str, str, str]:
    """SLOMet (status, reason, message) from status.slo; the reconcile and the autoscaler share it."""
    attainment = slo.get("attainment")
    if isinstance(attainment, int | float) and not isinstance(attainment, bool):
        met = attainment * 100.0 >= percentile
        return ("True" if met else "False", "ObjectivesMet" if met else "ObjectivesMissed",
                f"{attainment:.1%} of requests within objectives in the worst class and objective "
                f"(target {percentile:g}%)")
    failed, scraped = int(slo.get("failedPods") or 0), int(slo.get("scrapedPods") or 0)
    if failed and not scraped:
        return ("Unknown", "MetricsUnavailable", f"no ready pod's /metrics could be read ({failed} failed)")
    if scraped:
        return ("Unknown", "NoMeasurements", "no requests measured in the window")
    return ("Unknown", "NoMeasurements", "no SLO measurements reported yet")


def with_condition(previous: Mapping[str, Any] | None, kind: str, value: tuple[str, str, str], *,
                   generation: int, now: str | None = None) -> list[dict[str, Any]]:
    """The previous conditions with `kind` set to `value` (its lastTransitionTime moves only on change)."""
    old = [c for c in (previous or {}).get("conditions") or [] if isinstance(c, Mapping) and "type" in c]
    updated = _conditions([(kind, *value)], generation=generation, previous=previous, now=now or now_iso())
    result = [dict(c) for c in old if c["type"] != kind] + updated
    order = {t: i for i, t in enumerate(CONDITION_TYPES)}
    return sorted(result, key=lambda c: order.get(str(c["type"]), len(order)))


def derive_status(*, name: str, namespace: str, generation: int, desired_replicas: int,
                  workload: WorkloadState, selector: Mapping[str, str], slo_percentile: float,
                  previous: Mapping[str, Any] | None, now: str | None = None,
                  slo: Mapping[str, Any] | None = None, holds_at_zero: bool = False) -> dict[str, Any]:
    """`selector`: the serving pods (manifests.serving_selector); `slo`: the autoscaler's latest status.slo
    when it has one, fresher than `previous`'s copy; `holds_at_zero`: a router holds requests while no replica runs, and an autoscaler starts one for them,
    so zero replicas is a state that serves (slowly), not an outage."""
    w = workload
    unit = "replicas" if w.kind == "Deployment" else "replicas (pod groups)"
    if not w.exists:
        ready_c = ("False", f"{w.kind}Missing", f"the {w.kind} does not exist yet")
    elif desired_replicas == 0 and holds_at_zero:
        ready_c = ("True", "ScaledToZero", "0 replicas: the router holds requests and a replica starts for them")
    elif desired_replicas == 0:
        ready_c = ("False", "ScaledToZero", "replicas is 0")
    elif w.ready >= desired_replicas and w.updated >= desired_replicas and not w.stale and w.available:
        ready_c = ("True", "AllReplicasReady", f"{w.ready}/{desired_replicas} {unit} ready")
    else:
        ready_c = ("False", "ReplicasNotReady", f"{w.ready}/{desired_replicas} {unit} ready")

    if not w.exists or w.stale or w.updated < desired_replicas or w.ready < desired_replicas or not w.available:
        progressing = ("True", "RollingOut", f"{w.updated}/{desired_replicas} {unit} updated, {w.ready} ready")
    else:
        progressing = ("False", "RolloutComplete", "every replica runs the current spec")

    slo_c = slo_condition(slo if slo is not None else (previous or {}).get("slo") or {}, slo_percentile)

    values = [("Ready", *ready_c), ("Progressing", *progressing), ("Degraded", *w.degraded), ("SLOMet", *slo_c)]
    status: dict[str, Any] = {
        "observedGeneration": generation, "replicas": w.replicas, "readyReplicas": w.ready,
        "selector": _selector(selector), "endpoint": f"http://{name}.{namespace}.svc.cluster.local:{PROXY_PORT}",
        "conditions": _conditions(values, generation=generation, previous=previous, now=now or now_iso()),
    }
    # status.slo itself is left out: the autoscaler writes it between reconciles, and this merge patch,
    # made from an older copy of the object, must not put stale figures back.
    return status
