"""The chart's monitoring objects: rendered only when enabled, valid against the upstream CRDs."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python
import jsonschema
import kubernetes_validate
import pytest
import yaml

from decodeservice.monitoring.panels import PANELS
from decodeservice.monitoring.rules import DEFAULT_MIN_REQUESTS, MIN_REQUESTS, rule_groups
from tests.operator.helpers import CHART

SCHEMAS = Path(__file__).resolve().parent / "schemas"
K8S_VERSION = "1.37"
ALL_ON = {"monitoring": {"dashboards": {"enabled": True, "annotations": {"grafana_folder": "LLM"}},
                         "podMonitor": {"enabled": True, "labels": {"release": "prom"}},
                         "rules": {"enabled": True, "labels": {"release": "prom"}}}}


@pytest.fixture(scope="module")
def chart() -> Iterator[helm_python.Chart]:
    with helm_python.Chart.load(CHART) as loaded:
        yield loaded


def render(chart: helm_python.Chart, values: dict[str, Any] | None) -> list[dict[str, Any]]:
    rendered = chart.render(values=values, name="dso", namespace="ops", is_install=True)
    return [d for path, text in rendered.items() if path.endswith(".yaml") for d in yaml.safe_load_all(text) if d]


def _structural(schema: Any) -> Any:
    """The CRD's schema as JSON schema, closed where the API server would prune unknown fields."""
    if isinstance(schema, list):
        return [_structural(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _structural(v) for k, v in schema.items() if not k.startswith("x-kubernetes-")}
    if out.pop("nullable", False):
        out["type"] = [out["type"], "null"]
    if ("properties" in out and "additionalProperties" not in out
            and not schema.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def crd_errors(obj: dict[str, Any], crd_file: str) -> list[str]:
    crd = yaml.safe_load((SCHEMAS / crd_file).read_text())
    assert obj["apiVersion"] == f"{crd['spec']['group']}/v1" and obj["kind"] == crd["spec"]["names"]["kind"]
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    schema = _structural(version["schema"]["openAPIV3Schema"])
    schema["properties"]["metadata"] = {"type": "object"}  # ObjectMeta: checked by kubernetes-validate below
    validator = jsonschema.Draft4Validator(schema)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)]


def _meta_is_valid(obj: dict[str, Any]) -> None:
    # The object's metadata, checked as a ConfigMap's (kubernetes-validate knows no CRD kinds).
    kubernetes_validate.validate({"apiVersion": "v1", "kind": "ConfigMap", "metadata": obj["metadata"]},
                                 K8S_VERSION, strict=True)


def test_nothing_is_rendered_by_default(chart: helm_python.Chart) -> None:
    kinds = {d["kind"] for d in render(chart, None)}
    assert not kinds & {"PodMonitor", "PrometheusRule"}
    assert not [d for d in render(chart, None) if d["kind"] == "ConfigMap"]


@pytest.mark.parametrize("part", ["dashboards", "podMonitor", "rules"])
def test_each_part_is_rendered_only_when_enabled(chart: helm_python.Chart, part: str) -> None:
    values = {"monitoring": {part: {"enabled": True}}}
    kinds = sorted(d["kind"] for d in render(chart, values) if d["kind"] in ("ConfigMap", "PodMonitor", "PrometheusRule"))
    assert kinds == {"dashboards": ["ConfigMap"], "podMonitor": ["PodMonitor", "PodMonitor"],
                     "rules": ["PrometheusRule"]}[part]


def test_the_dashboard_configmap_carries_the_sidecar_label_and_the_generated_json(chart: helm_python.Chart) -> None:
    cm = next(d for d in render(chart, ALL_ON) if d["kind"] == "ConfigMap")
    kubernetes_validate.validate(cm, K8S_VERSION, strict=True)
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "LLM"}
    board = json.loads(cm["data"]["decodeservice.json"])
    queries = [t["expr"] for p in board["panels"] if p["type"] != "row" for t in p["targets"]]
    assert queries == [q.expr for p in PANELS for q in p.queries]
    other_ns = copy.deepcopy(ALL_ON)
    other_ns["monitoring"]["dashboards"]["namespace"] = "grafana"
    cm = next(d for d in render(chart, other_ns) if d["kind"] == "ConfigMap")
    assert cm["metadata"]["namespace"] == "grafana"


def test_the_pod_monitors_are_valid_and_label_the_series(chart: helm_python.Chart) -> None:
    monitors = {d["metadata"]["name"]: d for d in render(chart, ALL_ON) if d["kind"] == "PodMonitor"}
    assert set(monitors) == {"dso-decodeservice-operator-services", "dso-decodeservice-operator-operator"}
    for monitor in monitors.values():
        assert crd_errors(monitor, "monitoring.coreos.com_podmonitors.yaml") == []
        _meta_is_valid(monitor)
        assert monitor["metadata"]["labels"]["release"] == "prom"
    pods = monitors["dso-decodeservice-operator-services"]
    assert pods["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/managed-by": "decodeservice-operator"}
    endpoint = pods["spec"]["podMetricsEndpoints"][0]
    assert endpoint["port"] == "http"  # the proxy's and the router's container port
    assert {r["targetLabel"] for r in endpoint["relabelings"]} == {"service", "component"}
    operator = monitors["dso-decodeservice-operator-operator"]["spec"]["podMetricsEndpoints"][0]
    assert operator["port"] == "metrics" and operator["honorLabels"] is True
    deployment = next(d for d in render(chart, ALL_ON) if d["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "metrics", "containerPort": 8081, "protocol": "TCP"} in container["ports"]
    assert container["args"][container["args"].index("--metrics") + 1] == "http://0.0.0.0:8081/metrics"


def test_the_prometheus_rule_is_valid_and_carries_the_generated_rules(chart: helm_python.Chart) -> None:
    rule = next(d for d in render(chart, ALL_ON) if d["kind"] == "PrometheusRule")
    assert crd_errors(rule, "monitoring.coreos.com_prometheusrules.yaml") == []
    _meta_is_valid(rule)
    assert rule["spec"] == rule_groups()
    assert rule["metadata"]["labels"]["release"] == "prom"


def test_min_requests_sets_the_recorded_threshold_and_nothing_else(chart: helm_python.Chart) -> None:
    values = copy.deepcopy(ALL_ON)
    values["monitoring"]["rules"]["minRequests"] = 25
    spec = next(d for d in render(chart, values) if d["kind"] == "PrometheusRule")["spec"]
    expected = rule_groups()
    threshold = next(r for r in expected["groups"][0]["rules"] if r.get("record") == MIN_REQUESTS)
    assert threshold["expr"] == f"vector({DEFAULT_MIN_REQUESTS})"
    threshold["expr"] = "vector(25)"
    assert spec == expected


@pytest.mark.parametrize(("value", "message"), [("many", "must be a number"), (-1, "must be >= 0")])
def test_a_bad_min_requests_fails_the_render(chart: helm_python.Chart, value: Any, message: str) -> None:
    values = copy.deepcopy(ALL_ON)
    values["monitoring"]["rules"]["minRequests"] = value
    with pytest.raises(helm_python.HelmError, match=message):
        render(chart, values)


def test_the_schema_check_can_fail(chart: helm_python.Chart) -> None:
    # Guards the guard: a misspelt field (pruned by the API server) and a wrong type are both caught.
    rule = next(d for d in render(chart, ALL_ON) if d["kind"] == "PrometheusRule")
    rule["spec"]["groups"][1]["rules"][0]["annotation"] = {"x": "y"}
    rule["spec"]["groups"][0]["interval"] = 30
    errors = crd_errors(rule, "monitoring.coreos.com_prometheusrules.yaml")
    assert len(errors) == 2, errors


@pytest.mark.parametrize("values", [None, ALL_ON], ids=["default", "all-on"])
def test_chart_passes_strict_lint(values: dict[str, Any] | None) -> None:
    report = helm_python.lint(CHART, values, strict=True, kube_version="v1.33.0")
    assert report["errors"] == [], report
    assert [m for m in report["messages"] if m["severity"] >= 2] == [], report
