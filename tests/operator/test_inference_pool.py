"""spec.routing.inferencePool: the rendered InferencePool, checked against the upstream CRD (vendored in
tests/operator/schemas/, see its README), and the operator with and without that CRD in the emulator.

What only a real cluster with the Gateway API Inference Extension can check: that a Gateway accepts the
pool, that the endpoint picker reaches the pods on the target port and reads the `vllm:*` series there
(the proxy relays them; that relay is the proxy's and is tested with the proxy).
"""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from kmock import ResourceInfo

from decodeservice.operator.engines import PROXY_PORT
from decodeservice.operator.errors import InvalidSpecError
from decodeservice.operator.inference_pool import ENGINE_TYPE_LABEL
from decodeservice.operator.manifests import Children, build_children
from decodeservice.operator.manifests import render as render_manifest
from decodeservice.operator.spec import validate_spec
from tests.operator.conftest import Cluster, run_operator
from tests.operator.helpers import EXAMPLES, example_paths, load, operator_roles
from tests.operator.schema import cel_eval, cel_rules, structural_errors
from tests.operator.test_operator_e2e import DS_PATH, condition, owned_by, smoke
from tests.support.kube_emulator import DEPLOYMENTS, DS

SCHEMA_PATH = Path(__file__).parent / "schemas" / "inference.networking.k8s.io_inferencepools.yaml"
POOLS = "inference.networking.k8s.io/v1/inferencepools"
PICKER = {"name": "smoke-epp", "port": {"number": 9002}}


def upstream_schema() -> dict[str, Any]:
    crd = yaml.safe_load(SCHEMA_PATH.read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    schema = version["schema"]["openAPIV3Schema"]
    assert isinstance(schema, dict)
    return schema


def pool_errors(pool: dict[str, Any]) -> list[str]:
    """What the API server would reject, from the upstream schema, its CEL rules and the targetPorts rule."""
    schema = upstream_schema()
    defaulted, errors = structural_errors(schema, pool)
    for path, rule in cel_rules(schema):
        node: Any = defaulted
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
        if path[-1:] == ("targetPorts",):
            # self.all(p1, self.exists_one(p2, p1.number==p2.number)): beyond our small CEL translator.
            numbers = [p.get("number") for p in node or []]
            if len(numbers) != len(set(numbers)):
                errors.append(f"targetPorts: {rule['message']}")
        elif isinstance(node, dict) and not cel_eval(rule["rule"], node):
            errors.append(f"{'.'.join(path)}: {rule['message']}")
    return errors


def render(routing: dict[str, Any] | None = None, **spec: Any) -> Children:
    body = copy.deepcopy(yaml.safe_load((EXAMPLES / "cpu-smoke.yaml").read_text()))["spec"]
    body.update(spec)
    if routing is not None:
        body["routing"] = routing
    return build_children(name="smoke", namespace="ml", v=validate_spec(body))


def on(**picker: Any) -> dict[str, Any]:
    return {"inferencePool": {"enabled": True, "endpointPickerRef": {**PICKER, **picker}}}


def test_off_by_default_and_no_engine_type_label() -> None:
    children = render()
    assert children.inference_pool is None
    assert ENGINE_TYPE_LABEL not in children.deployment["spec"]["template"]["metadata"]["labels"]
    assert [o["kind"] for o in children.all()] == ["ConfigMap", "Service", "Deployment"]


def test_the_rendered_pool_validates_against_the_upstream_crd() -> None:
    pool = render(on(failureMode="FailOpen")).inference_pool
    assert pool is not None
    assert pool_errors(pool) == []
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1" and pool["kind"] == "InferencePool"
    assert pool["spec"]["endpointPickerRef"] == {"group": "", "kind": "Service", "name": "smoke-epp",
                                                 "port": {"number": 9002}, "failureMode": "FailOpen"}


def test_every_example_with_a_pool_renders_a_valid_one() -> None:
    pools = [render_manifest(load(p)).inference_pool for p in example_paths()]
    assert any(pools)
    assert [pool_errors(p) for p in pools if p is not None] == [[] for p in pools if p is not None]


def test_the_checker_rejects_what_the_api_server_would() -> None:
    # The schema and rules bite: each broken pool is refused, so the pass above means something.
    good = render(on()).inference_pool
    assert good is not None
    broken = {
        "no ports": lambda p: p["spec"].update(targetPorts=[]),
        "nine ports": lambda p: p["spec"].update(targetPorts=[{"number": 8000 + i} for i in range(9)]),
        "duplicate ports": lambda p: p["spec"].update(targetPorts=[{"number": 8000}, {"number": 8000}]),
        "service picker without a port": lambda p: p["spec"]["endpointPickerRef"].pop("port"),
        "empty selector": lambda p: p["spec"]["selector"].update(matchLabels={}),
        "bad failure mode": lambda p: p["spec"]["endpointPickerRef"].update(failureMode="Retry"),
    }
    for what, change in broken.items():
        pool = copy.deepcopy(good)
        change(pool)
        assert pool_errors(pool), what


def test_selector_is_a_stable_subset_of_the_pod_labels_and_targets_the_proxy() -> None:
    children = render(on())
    pool = children.inference_pool
    assert pool is not None
    template = children.deployment["spec"]["template"]
    selector = pool["spec"]["selector"]["matchLabels"]
    assert selector.items() <= template["metadata"]["labels"].items()
    assert selector == children.deployment["spec"]["selector"]["matchLabels"]  # what the ReplicaSets keep
    assert "pod-template-hash" not in selector
    assert template["metadata"]["labels"][ENGINE_TYPE_LABEL] == "vllm"
    proxy = next(c for c in template["spec"]["containers"] if c["name"] == "proxy")
    assert pool["spec"]["targetPorts"] == [{"number": proxy["ports"][0]["containerPort"]}]
    assert pool["spec"]["targetPorts"] == [{"number": PROXY_PORT}]
    # Another model, policy and replica count: a new pod template, the same selector.
    other = render(on(), model={"uri": "hf://org/other"}, replicas=4,
                   policies={"slo": {"ttftMs": 300}}).inference_pool
    assert other is not None and other["spec"]["selector"] == pool["spec"]["selector"]


def test_enabled_without_a_picker_is_an_invalid_spec() -> None:
    with pytest.raises(InvalidSpecError, match="endpointPickerRef is required"):
        render({"inferencePool": {"enabled": True}})
    with pytest.raises(InvalidSpecError, match="port is required"):
        render({"inferencePool": {"enabled": True, "endpointPickerRef": {"name": "epp"}}})


def test_decodectl_render_shows_the_pool(tmp_path: Path) -> None:
    body = smoke()
    body["spec"]["routing"] = on()
    path = tmp_path / "ds.yaml"
    path.write_text(yaml.safe_dump(body))
    result = subprocess.run([sys.executable, "-P", "-m", "decodeservice.cli.main", "render", "-f", str(path)],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    docs = list(yaml.safe_load_all(result.stdout))
    assert [d["kind"] for d in docs] == ["ConfigMap", "Service", "Deployment", "InferencePool"]
    assert pool_errors(docs[-1]) == []


def pool_ready(cluster: Cluster) -> dict[str, Any]:
    return condition(cluster.get(DS, "smoke"), "InferencePoolReady")


async def test_without_the_crd_the_pool_is_skipped_and_said_so(cluster: Cluster) -> None:
    body = smoke()
    body["spec"]["routing"] = on()
    async for _ in run_operator(cluster):
        await cluster.create(body)
        cond = await cluster.wait_for(lambda: pool_ready(cluster), what="InferencePoolReady")
        assert (cond["status"], cond["reason"]) == ("False", "CRDNotInstalled")
        # The rest of the reconcile went on: children applied, the status written.
        dep = cluster.get(DEPLOYMENTS, "smoke")
        assert dep is not None and dep["spec"]["template"]["metadata"]["labels"][ENGINE_TYPE_LABEL] == "vllm"
        assert condition(cluster.get(DS, "smoke"), "Progressing")["status"] == "True"


async def test_with_the_crd_the_pool_is_owned_and_goes_when_disabled(cluster: Cluster) -> None:
    cluster.server.resources[POOLS] = ResourceInfo(kind="InferencePool", namespaced=True,
                                                   verbs={"get", "list", "watch", "create", "patch", "delete"})
    body = smoke()
    body["spec"]["routing"] = on()
    async for _ in run_operator(cluster):
        await cluster.create(body)
        pool = await cluster.wait_for(lambda: cluster.get(POOLS, "smoke"), what="InferencePool")
        assert owned_by(pool, cluster.get(DS, "smoke") or {})
        assert pool_errors({k: v for k, v in pool.items() if k in ("apiVersion", "kind", "spec")}) == []
        await cluster.wait_for(lambda: pool_ready(cluster).get("status") == "True", what="InferencePoolReady=True")

        await cluster.patch(f"{DS_PATH}/smoke", {"spec": {"routing": {"inferencePool": {"enabled": False}}}})
        await cluster.wait_for(lambda: cluster.get(POOLS, "smoke") is None, what="pool deleted")
        await cluster.wait_for(lambda: ENGINE_TYPE_LABEL not in (cluster.get(DEPLOYMENTS, "smoke") or {})[
            "spec"]["template"]["metadata"]["labels"], what="engine-type label removed")
        await cluster.wait_for(lambda: not pool_ready(cluster), what="condition dropped")


@pytest.mark.parametrize("values", [None, {"watchNamespaces": ["team-a"]}], ids=["cluster-wide", "namespaced"])
def test_chart_rbac_grants_only_what_the_pool_needs(values: dict[str, Any] | None) -> None:
    roles = operator_roles(values)
    assert roles
    for role in roles:
        rules = [r for r in role["rules"] if "inference.networking.k8s.io" in r["apiGroups"]]
        assert rules == [{"apiGroups": ["inference.networking.k8s.io"], "resources": ["inferencepools"],
                          "verbs": ["get", "create", "patch", "delete"]}]
