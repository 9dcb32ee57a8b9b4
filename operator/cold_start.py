"""status.coldStart: how long a new replica takes from its pod's creation to Ready, from the pods alone.

A replica's cold start is everything between the scheduler's first look and the first request it can
take: scheduling, the image pull, the model download (the init container), the load, the engine's kernel
measurements (kept on the model-cache PVC where there is one, so later replicas skip them) and compiled
graphs. The kubelet records both ends on the pod: metadata.creationTimestamp and the Ready condition's
lastTransitionTime. Pure function, no API calls: the reconcile and the autoscaler's tick both list the
serving pods and write what this returns.

- lastSeconds: the cold start of the pod that became Ready last (the figure a scale-up waits for now);
- replicas: how many of the live pods it was measured over (each Ready pod is one measurement).

A pod whose containers restarted after it was Ready counts until its latest Ready transition: that is
the time it spent unready since creation, which is what the service paid.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any


def _time(value: Any) -> datetime | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


def _ready_since(pod: Mapping[str, Any]) -> datetime | None:
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if isinstance(cond, Mapping) and cond.get("type") == "Ready":
            return _time(cond.get("lastTransitionTime")) if cond.get("status") == "True" else None
    return None


def cold_start(pods: Iterable[Mapping[str, Any]]) -> dict[str, Any] | None:
    """{lastSeconds, replicas} over the Ready pods that carry both times; None when none does."""
    measured: list[tuple[datetime, float]] = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        created, ready = _time(meta.get("creationTimestamp")), _ready_since(pod)
        if meta.get("deletionTimestamp") or created is None or ready is None or ready < created:
            continue
        measured.append((ready, (ready - created).total_seconds()))
    if not measured:
        return None
    _, seconds = max(measured)
    return {"lastSeconds": round(seconds, 1), "replicas": len(measured)}
