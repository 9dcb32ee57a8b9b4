"""What one decision writes: `status.slo` and the Event body. Pure functions, no API calls."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from decodeservice.operator.autoscaler.types import ScaleDecision
from decodeservice.operator.spec import GROUP, KIND, VERSION

COMPONENT = "decodeservice-operator"


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 3)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def slo_status(decision: ScaleDecision, *, observed_time: str, last_scale_time: str | None) -> dict[str, Any]:
    """status.slo for one decision. Keys whose value is unknown are None, which a merge patch deletes."""
    classes = []
    for name, c in sorted(decision.classes.items()):
        entry = {"name": name, "ttftMs": _ms(c.ttft_seconds), "itlMs": _ms(c.itl_seconds),
                 "ttftAttainment": _round(c.ttft_attainment), "itlAttainment": _round(c.itl_attainment),
                 "signal": _round(c.signal), "requests": c.requests}
        classes.append({k: v for k, v in entry.items() if v is not None})
    attainments = [a for c in decision.classes.values() for a in (c.ttft_attainment, c.itl_attainment)
                   if a is not None]
    ttfts = [c.ttft_seconds for c in decision.classes.values() if c.ttft_seconds is not None]
    itls = [c.itl_seconds for c in decision.classes.values() if c.itl_seconds is not None]
    return {
        # The worst class and objective: SLOMet is True only when every one holds.
        "attainment": _round(min(attainments)) if attainments else None,
        "ttftP95Ms": _ms(max(ttfts)) if ttfts else None,
        "itlP95Ms": _ms(max(itls)) if itls else None,
        "signal": _round(decision.signal),
        "panic": decision.panic,
        "desiredReplicas": decision.desired_replicas,
        "currentReplicas": decision.current_replicas,
        "scrapedPods": decision.scraped_pods,
        "failedPods": decision.failed_pods,
        "reason": decision.reason,
        "classes": classes,
        "observedTime": observed_time,
        "lastScaleTime": last_scale_time,
    }


def same_measurement(new: Mapping[str, Any], live: Mapping[str, Any] | None) -> bool:
    """True when writing `new` would change nothing but the observation time (the write is skipped)."""
    def strip(slo: Mapping[str, Any] | None) -> dict[str, Any]:
        return {k: v for k, v in (slo or {}).items() if v is not None and k != "observedTime"}
    return strip(new) == strip(live)


def scale_event(decision: ScaleDecision, *, name: str, namespace: str, uid: str, now: str) -> dict[str, Any]:
    """A core v1 Event on the DecodeService saying why its replicas changed."""
    up = decision.desired_replicas > decision.current_replicas
    failed = f"; {decision.failed_pods} pod(s) unreadable" if decision.failed_pods else ""
    message = (f"{decision.current_replicas} -> {decision.desired_replicas} replicas: {decision.reason}"
               f"{' (panic)' if decision.panic else ''}{failed}")
    return {
        "apiVersion": "v1", "kind": "Event",
        # Unique by construction, as client-go's recorder names them: <object>.<random>.
        "metadata": {"name": f"{name}.{uuid.uuid4().hex[:16]}", "namespace": namespace},
        "involvedObject": {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": name,
                           "namespace": namespace, "uid": uid},
        "reason": "ScaledUp" if up else "ScaledDown",
        "message": message[:1024],
        "type": "Normal",
        "source": {"component": COMPONENT},
        "reportingComponent": COMPONENT,
        "reportingInstance": COMPONENT,
        "firstTimestamp": now, "lastTimestamp": now, "count": 1,
    }
