"""Shared paths and loaders for the operator tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
CRD_PATH = ROOT / "crds" / "decodeservice.yaml"
CHART = ROOT / "charts" / "decodeservice-operator"


def load(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict)
    return data


def example_paths() -> list[Path]:
    return sorted(EXAMPLES.glob("*.yaml"))


def pod_templates(workload: dict[str, Any]) -> list[dict[str, Any]]:
    """A Deployment's pod template, or a LeaderWorkerSet's leader and worker templates (in that order)."""
    if workload["kind"] == "LeaderWorkerSet":
        templates = workload["spec"]["leaderWorkerTemplate"]
        return [templates["leaderTemplate"], templates["workerTemplate"]]
    return [workload["spec"]["template"]]


def as_pod_templates(workload: dict[str, Any]) -> list[dict[str, Any]]:
    """The workload itself, or for a LeaderWorkerSet (a CRD kind kubernetes-validate does not know) each of
    its templates as a core/v1 PodTemplate, which kubernetes-validate checks against the Kubernetes schema."""
    if workload["kind"] != "LeaderWorkerSet":
        return [workload]
    meta = workload["metadata"]
    return [{"apiVersion": "v1", "kind": "PodTemplate",
             "metadata": {"name": f"{meta['name']}-{role}", "namespace": meta["namespace"]}, "template": t}
            for role, t in zip(("leader", "worker"), pod_templates(workload), strict=True)]


def operator_roles(values: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The chart's Roles and ClusterRoles for the operator itself (not its discovery role), rendered."""
    import helm_python  # the real Helm SDK; imported here so other helpers load without it

    with helm_python.Chart.load(CHART) as chart:
        rendered = chart.render(values=values, name="dso", namespace="ops", is_install=True)
    return [d for path, text in rendered.items() if path.endswith(".yaml") for d in yaml.safe_load_all(text)
            if d and d["kind"] in ("Role", "ClusterRole") and not d["metadata"]["name"].endswith("-discovery")]
