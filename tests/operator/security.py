"""The security checks shared by the chart and operator tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


def pod_specs(obj: dict[str, Any]) -> list[dict[str, Any]]:
    """The pod specs an object's controller creates pods from (a LeaderWorkerSet has two templates)."""
    if obj.get("kind") in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
        return [obj["spec"]["template"]["spec"]]
    if obj.get("kind") == "LeaderWorkerSet":
        templates = obj["spec"]["leaderWorkerTemplate"]
        return [templates[t]["spec"] for t in ("leaderTemplate", "workerTemplate") if t in templates]
    return []


def containers(obj: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for spec in pod_specs(obj):
        yield from spec.get("initContainers", [])
        yield from spec["containers"]


def restricted_violations(obj: dict[str, Any]) -> list[str]:
    """Pod Security Standards "restricted", plus a read-only root filesystem."""
    problems = []
    for spec in pod_specs(obj):
        pod_ctx = spec.get("securityContext") or {}
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            ctx = c.get("securityContext") or {}
            name = f"{obj['metadata']['name']}/{c['name']}"
            if not (ctx.get("runAsNonRoot") or pod_ctx.get("runAsNonRoot")):
                problems.append(f"{name}: runAsNonRoot")
            if ctx.get("allowPrivilegeEscalation") is not False:
                problems.append(f"{name}: allowPrivilegeEscalation")
            if ctx.get("capabilities", {}).get("drop") != ["ALL"] or ctx.get("capabilities", {}).get("add"):
                problems.append(f"{name}: capabilities")
            seccomp = (ctx.get("seccompProfile") or pod_ctx.get("seccompProfile") or {}).get("type")
            if seccomp not in ("RuntimeDefault", "Localhost"):
                problems.append(f"{name}: seccompProfile")
            if ctx.get("readOnlyRootFilesystem") is not True:
                problems.append(f"{name}: readOnlyRootFilesystem")
            if ctx.get("privileged"):
                problems.append(f"{name}: privileged")
        for volume in spec.get("volumes", []):
            if "hostPath" in volume:
                problems.append(f"{obj['metadata']['name']}: hostPath volume {volume['name']}")
    return problems


def rbac_violations(obj: dict[str, Any]) -> list[str]:
    if obj.get("kind") not in ("Role", "ClusterRole"):
        return []
    problems = []
    for rule in obj.get("rules", []):
        for field in ("apiGroups", "resources", "verbs", "resourceNames"):
            if "*" in rule.get(field, []):
                problems.append(f"{obj['metadata']['name']}: wildcard in {field}")
        if "secrets" in rule.get("resources", []):
            problems.append(f"{obj['metadata']['name']}: grants {rule['verbs']} on secrets")
    return problems
