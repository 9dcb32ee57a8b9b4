"""The Helm chart, rendered and linted by the real Helm SDK (helm-python-sdk), then validated."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import helm_python
import kubernetes_validate
import pytest
import yaml

from tests.operator.helpers import CHART
from tests.operator.security import containers, rbac_violations, restricted_violations

K8S_VERSION = "1.37"  # the newest kubernetes-validate ships schemas for
CUSTOM = {"image": {"repository": "registry.example.com/ds", "tag": "9.9.9", "cudaTag": "9.9.9-gpu"}, "watchNamespaces": ["team-a", "team-b"],
          "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}},
          "podAnnotations": {"a": "b"}, "nodeSelector": {"pool": "system"}, "resyncSeconds": 30}


@pytest.fixture(scope="module")
def chart() -> Iterator[helm_python.Chart]:
    with helm_python.Chart.load(CHART) as loaded:
        yield loaded


def render(chart: helm_python.Chart, values: dict[str, Any] | None) -> list[dict[str, Any]]:
    rendered = chart.render(values=values, name="dso", namespace="ops", is_install=True)
    docs = []
    for path, text in rendered.items():
        if path.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


@pytest.mark.parametrize("values", [None, CUSTOM], ids=["default", "custom"])
def test_chart_renders_valid_manifests(chart: helm_python.Chart, values: dict[str, Any] | None) -> None:
    docs = render(chart, values)
    kinds = sorted(d["kind"] for d in docs)
    assert "Deployment" in kinds and "ServiceAccount" in kinds
    for doc in docs:
        if doc["apiVersion"].startswith("monitoring.coreos.com"):
            continue  # a CRD-backed kind: kubernetes-validate has no schema for it (checked below by hand)
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_default_values_run_cluster_wide_with_the_default_image(chart: helm_python.Chart) -> None:
    docs = render(chart, None)
    dep = next(d for d in docs if d["kind"] == "Deployment")
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == f"ghcr.io/decodeservice/decodeservice:{chart.metadata['appVersion']}"
    assert "--all-namespaces" in container["args"]
    args = container["args"]
    assert args[args.index("--image") + 1] == f"ghcr.io/decodeservice/decodeservice:{chart.metadata['appVersion']}"
    assert args[args.index("--cuda-image") + 1] == f"ghcr.io/decodeservice/decodeservice:{chart.metadata['appVersion']}-cuda"
    assert container["args"][container["args"].index("--autoscale-interval-seconds") + 1] == "5"
    assert {d["kind"] for d in docs} >= {"ClusterRole", "ClusterRoleBinding"}
    assert not any(d["kind"] == "ServiceMonitor" for d in docs)


def test_custom_values_scope_rbac_and_override_the_image(chart: helm_python.Chart) -> None:
    docs = render(chart, CUSTOM)
    dep = next(d for d in docs if d["kind"] == "Deployment")
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "registry.example.com/ds:9.9.9"
    assert container["args"][container["args"].index("--cuda-image") + 1] == "registry.example.com/ds:9.9.9-gpu"
    assert container["args"][:5] == ["operator", "--namespace", "team-a", "--namespace", "team-b"]
    roles = [d for d in docs if d["kind"] == "Role"]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    monitor = next(d for d in docs if d["kind"] == "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["namespaceSelector"]["matchNames"] == ["team-a", "team-b"]


@pytest.mark.parametrize("values", [None, CUSTOM], ids=["default", "custom"])
def test_chart_passes_strict_lint(values: dict[str, Any] | None) -> None:
    report = helm_python.lint(CHART, values, strict=True, kube_version="v1.33.0")
    assert report["errors"] == [], report
    assert [m for m in report["messages"] if m["severity"] >= 2] == [], report


@pytest.mark.parametrize("values", [None, CUSTOM], ids=["default", "custom"])
def test_chart_security(chart: helm_python.Chart, values: dict[str, Any] | None) -> None:
    docs = render(chart, values)
    assert any(True for d in docs for _ in containers(d))
    problems = [p for d in docs for p in restricted_violations(d) + rbac_violations(d)]
    assert problems == []


def test_every_values_key_is_documented() -> None:
    # Every key has a `# --` comment right above it, unless an ancestor is documented as a whole
    # (podSecurityContext documents its body) or it only groups documented keys (image:, metrics:).
    lines = (CHART / "values.yaml").read_text().splitlines()
    documented_parents: list[tuple[int, bool]] = []  # (indent, documented) of the open ancestors
    for i, line in enumerate(lines):
        stripped = line.strip()
        if not stripped or stripped.startswith("#") or stripped.startswith("- ") or ":" not in stripped:
            continue
        indent = len(line) - len(line.lstrip())
        while documented_parents and documented_parents[-1][0] >= indent:
            documented_parents.pop()
        documented = lines[i - 1].strip().startswith("# --")
        is_group = stripped.endswith(":")
        if not (documented or is_group or any(d for _, d in documented_parents)):
            raise AssertionError(f"values.yaml:{i + 1} {stripped!r} lacks a '# --' comment")
        documented_parents.append((indent, documented))


def test_chart_crd_is_not_templated(chart: helm_python.Chart) -> None:
    assert [c["name"] for c in chart.crds] == ["crds/decodeservice.yaml"]
    assert not any("CustomResourceDefinition" in t["data"] for t in chart.templates)


@pytest.mark.parametrize(("values", "kind"), [(None, "ClusterRole"), (CUSTOM, "Role")], ids=["default", "custom"])
def test_rbac_lets_the_autoscaler_read_pods_and_post_events(chart: helm_python.Chart, values: dict[str, Any] | None,
                                                          kind: str) -> None:
    role = next(d for d in render(chart, values) if d["kind"] == kind and not d["metadata"]["name"].endswith(
        "-discovery"))
    granted = {(group, res, verb) for r in role["rules"] for group in r["apiGroups"] for res in r["resources"]
               for verb in r["verbs"]}
    assert {("", "pods", v) for v in ("get", "list", "watch")} <= granted
    assert {("", "events", "create"), ("", "events", "patch"), ("apps", "deployments", "patch")} <= granted
    assert not {v for g, res, v in granted if res == "pods"} - {"get", "list", "watch"}  # read-only on pods
