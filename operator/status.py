"""DecodeService status, derived from the children's status: pure functions, no API calls.

Each condition carries observedGeneration; lastTransitionTime only moves when the status value changes,
so a resync that finds nothing new leaves the timestamps alone.
"""

from __future__ import annotations

from collections.abc import Mapping
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


def _selector(name: str) -> str:
    return ",".join(f"{k}={v}" for k, v in selector_labels(name).items())


def invalid_status(*, name: str, generation: int, reason: str, message: str,
                   previous: Mapping[str, Any] | None, now: str | None = None) -> dict[str, Any]:
    """Status of a DecodeService whose spec cannot be served: Ready=False with the reason, nothing rolled."""
    values = [("Ready", "False", reason, message),
              ("Progressing", "False", reason, "not reconciled until the spec is fixed"),
              ("Degraded", "True", reason, message),
              ("SLOMet", "Unknown", "NoMeasurements", "no pods are serving")]
    prev = previous or {}
    return {"observedGeneration": generation, "replicas": int(prev.get("replicas") or 0),
            "readyReplicas": int(prev.get("readyReplicas") or 0), "selector": _selector(name),
            "conditions": _conditions(values, generation=generation, previous=previous, now=now or now_iso())}


def _deployment_condition(deployment: Mapping[str, Any], kind: str) -> Mapping[str, Any]:
    for cond in (deployment.get("status") or {}).get("conditions") or []:
        if isinstance(cond, Mapping) and cond.get("type") == kind:
            return cond
    return {}


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
                  deployment: Mapping[str, Any] | None, slo_percentile: float,
                  previous: Mapping[str, Any] | None, now: str | None = None,
                  slo: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """`slo`: the autoscaler's latest status.slo when it has one, fresher than `previous`'s copy."""
    dep_status: Mapping[str, Any] = (deployment or {}).get("status") or {}
    replicas = int(dep_status.get("replicas") or 0)
    ready = int(dep_status.get("readyReplicas") or 0)
    updated = int(dep_status.get("updatedReplicas") or 0)
    dep_meta: Mapping[str, Any] = (deployment or {}).get("metadata") or {}
    # A Deployment controller that has not seen the latest template yet means the rollout has not begun.
    stale = int(dep_status.get("observedGeneration") or 0) < int(dep_meta.get("generation") or 0)

    if deployment is None:
        ready_c = ("False", "DeploymentMissing", "the Deployment does not exist yet")
    elif desired_replicas == 0:
        ready_c = ("False", "ScaledToZero", "replicas is 0")
    elif ready >= desired_replicas and updated >= desired_replicas and not stale:
        ready_c = ("True", "AllReplicasReady", f"{ready}/{desired_replicas} replicas ready")
    else:
        ready_c = ("False", "ReplicasNotReady", f"{ready}/{desired_replicas} replicas ready")

    progress = _deployment_condition(deployment or {}, "Progressing")
    failure = _deployment_condition(deployment or {}, "ReplicaFailure")
    if progress.get("reason") == "ProgressDeadlineExceeded":
        degraded = ("True", "ProgressDeadlineExceeded", str(progress.get("message") or "rollout stalled"))
    elif failure.get("status") == "True":
        degraded = ("True", str(failure.get("reason") or "ReplicaFailure"), str(failure.get("message") or ""))
    else:
        degraded = ("False", "AsExpected", "no failures reported")

    if deployment is None or stale or updated < desired_replicas or ready < desired_replicas:
        progressing = ("True", "RollingOut", f"{updated}/{desired_replicas} replicas updated, {ready} ready")
    else:
        progressing = ("False", "RolloutComplete", "every replica runs the current spec")

    slo_c = slo_condition(slo if slo is not None else (previous or {}).get("slo") or {}, slo_percentile)

    values = [("Ready", *ready_c), ("Progressing", *progressing), ("Degraded", *degraded), ("SLOMet", *slo_c)]
    status: dict[str, Any] = {
        "observedGeneration": generation, "replicas": replicas, "readyReplicas": ready,
        "selector": _selector(name), "endpoint": f"http://{name}.{namespace}.svc.cluster.local:{PROXY_PORT}",
        "conditions": _conditions(values, generation=generation, previous=previous, now=now or now_iso()),
    }
    # status.slo itself is left out: the autoscaler writes it between reconciles, and this merge patch,
    # made from an older copy of the object, must not put stale figures back.
    return status
