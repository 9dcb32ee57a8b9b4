"""The CRD: examples validate, invalid manifests are rejected (cross-field CEL rules included), and the
CRD, the chart's copy, the Python spec and the proxy's Policy model agree."""

from __future__ import annotations

import copy
import typing
from collections.abc import Callable
from typing import Any

import pytest
from pydantic import BaseModel

from decodeservice.operator.errors import InvalidSpecError
from decodeservice.operator.spec import CEL_RULES, AutoscalingSpec, validate_spec
from decodeservice.proxy.policy import Policy
from tests.operator.helpers import CHART, CRD_PATH, example_paths, load
from tests.operator.schema import _at, apply_defaults, cel_eval, cel_rules, open_api_schema, validate


def base() -> dict[str, Any]:
    return load(CRD_PATH.parents[1] / "examples" / "cpu-smoke.yaml")


def with_spec(change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    obj = copy.deepcopy(base())
    change(obj["spec"])
    return obj


# (id, mutation, error text the CRD gives) — each is also rejected by the operator's Python validation.
INVALID: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("bad-uri", lambda s: s["model"].update(uri="s3://bucket/model"), "does not match"),
    ("no-model", lambda s: s.pop("model"), "'model' is a required property"),
    ("bad-kind", lambda s: s["engine"].update(kind="tgi"), "is not one of"),
    ("negative-replicas", lambda s: s.update(replicas=-1), "less than the minimum"),
    ("zero-fraction", lambda s: s["engine"].update(gpuMemoryFraction=0, kvCacheGiB=None), "less than or equal"),
    ("bad-quantity", lambda s: s["resources"].update(memory="lots"), "does not match"),
    ("policy-bad-mode", lambda s: s["policies"]["outputLength"].update(mode="truncate"), "is not one of"),
    ("cel-kv-and-fraction", lambda s: s["engine"].update(gpuMemoryFraction=0.5), "not both"),
    ("cel-draft-needs-model", lambda s: s["engine"].update(speculative={"method": "draft"}), "draftModel is required"),
    ("cel-draft-model-unused", lambda s: s["engine"].update(
        speculative={"method": "ngram", "draftModel": "bundled://smollm2-135m"}), "only used when method is draft"),
    ("cel-min-over-max", lambda s: s.update(autoscaling={"mode": "builtin", "minReplicas": 5, "maxReplicas": 2}),
     "minReplicas must be <= maxReplicas"),
    ("cel-thresholds-crossed", lambda s: s.update(autoscaling={"scaleUpThreshold": 0.5, "scaleDownThreshold": 0.6}),
     "scaleDownThreshold must be < scaleUpThreshold"),
    ("cel-panic-over-stable", lambda s: s.update(autoscaling={"stableWindowSeconds": 5, "panicWindowSeconds": 6}),
     "panicWindowSeconds must be <= stableWindowSeconds"),
    ("kv-threshold-over-one", lambda s: s.update(autoscaling={"kvUsageThreshold": 1.5}), "greater than the maximum"),
    ("interval-too-short", lambda s: s.update(autoscaling={"intervalSeconds": 0.01}), "less than the minimum"),
    ("cel-vllm-self-draft", lambda s: (s["model"].update(uri="hf://org/model"), s["resources"].update(gpus=1),
                                       s["engine"].update(kind="vllm", kvCacheGiB=None,
                                                          speculative={"method": "self_draft"})),
     "does not support self_draft"),
    ("cel-vllm-bundled", lambda s: (s["resources"].update(gpus=1), s["engine"].update(kind="vllm", kvCacheGiB=None)),
     "builtin engine only"),
    ("cel-pool-needs-picker", lambda s: s.update(routing={"inferencePool": {"enabled": True}}),
     "endpointPickerRef is required"),
    ("cel-picker-service-port", lambda s: s.update(routing={"inferencePool": {
        "enabled": True, "endpointPickerRef": {"name": "epp"}}}), "port is required when kind is 'Service'"),
    ("cel-multinode-builtin", lambda s: s["resources"].update(nodes=2), "needs engine.kind: vllm"),
    ("zero-nodes", lambda s: s["resources"].update(nodes=0), "less than the minimum"),
    ("cel-rollout-stuck", lambda s: s.update(rollout={"maxSurge": 0, "maxUnavailable": 0}), "cannot both be 0"),
    ("cel-default-over-cap", lambda s: s["policies"]["outputLength"].update(defaultMaxTokens=4096),
     "defaultMaxTokens must be <= maxOutputTokens"),
]


def _clean(obj: Any) -> Any:
    # The mutations use None to mean "remove this key", as a merge patch would.
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items() if v is not None}
    return obj


@pytest.mark.parametrize("path", example_paths(), ids=lambda p: p.name)
def test_examples_validate_against_the_crd_and_the_operator(path: Any) -> None:
    obj = load(path)
    assert validate(obj) == []
    validate_spec(obj["spec"])


def test_examples_cover_cpu_gpu_speculative_and_vllm() -> None:
    specs = [load(p)["spec"] for p in example_paths()]
    assert any(s["model"]["uri"] == "bundled://smollm2-135m" and s["resources"]["gpus"] == 0 for s in specs)
    assert any(s["resources"]["gpus"] > 0 and s["engine"]["speculative"]["method"] == "draft" for s in specs)
    assert any(s["engine"]["kind"] == "vllm" for s in specs)


@pytest.mark.parametrize(("mutate", "message"), [(m, msg) for _, m, msg in INVALID], ids=[i for i, _, _ in INVALID])
def test_invalid_manifests_are_rejected_by_crd_and_operator(mutate: Callable[[dict[str, Any]], None],
                                                            message: str) -> None:
    obj = _clean(with_spec(mutate))
    errors = validate(obj)
    assert any(message in e for e in errors), errors
    with pytest.raises(InvalidSpecError):
        validate_spec(obj["spec"])


def test_cel_rules_in_crd_are_exactly_the_python_twins() -> None:
    in_crd = {(path[1:], r["rule"], r["message"]) for path, r in cel_rules(open_api_schema())}
    in_python = {(rule.path, rule.rule, rule.message) for rule in CEL_RULES}
    assert in_crd == in_python


@pytest.mark.parametrize("case", ["examples", "invalid"])
def test_cel_evaluator_and_python_twins_agree(case: str) -> None:
    objs = ([load(p) for p in example_paths()] if case == "examples"
            else [_clean(with_spec(m)) for _, m, _ in INVALID])
    verdicts = 0
    for obj in objs:
        defaulted = apply_defaults(open_api_schema(), obj)["spec"]
        for rule in CEL_RULES:
            node = _at(defaulted, rule.path)
            if isinstance(node, dict):
                assert cel_eval(rule.rule, node) == rule.check(node), (rule.rule, node)
                verdicts += not rule.check(node)
    assert (verdicts == 0) if case == "examples" else (verdicts >= 7)


def _schema_fields(schema: dict[str, Any]) -> dict[str, Any]:
    return {k: _schema_fields(v) if v.get("type") == "object" else None
            for k, v in (schema.get("properties") or {}).items()}


def _model_fields(model: type[BaseModel]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        sub = info.annotation
        inner = [a for a in typing.get_args(sub) if a is not type(None)]
        if len(inner) == 1 and len(typing.get_args(sub)) == 2:  # `X | None`
            sub = inner[0]
        key = info.alias or name
        out[key] = _model_fields(sub) if isinstance(sub, type) and issubclass(sub, BaseModel) else None
    return out


def test_crd_policies_schema_matches_the_proxy_policy_model() -> None:
    policies = open_api_schema()["properties"]["spec"]["properties"]["policies"]
    assert _schema_fields(policies) == _model_fields(Policy)


def test_crd_autoscaling_schema_matches_the_spec_model() -> None:
    autoscaling = open_api_schema()["properties"]["spec"]["properties"]["autoscaling"]
    assert _schema_fields(autoscaling) == _model_fields(AutoscalingSpec)


def test_crd_defaults_match_the_policy_defaults() -> None:
    policies = open_api_schema()["properties"]["spec"]["properties"]["policies"]
    assert _clean(apply_defaults(policies, {})) == _clean(Policy().to_dict())


def test_chart_carries_an_identical_copy_of_the_crd() -> None:
    assert (CHART / "crds" / "decodeservice.yaml").read_bytes() == CRD_PATH.read_bytes()


def test_crd_has_descriptions_everywhere_and_the_required_shape() -> None:
    crd = load(CRD_PATH)
    spec = crd["spec"]
    assert (spec["group"], spec["names"]["kind"], spec["names"]["plural"]) == ("decode.dev", "DecodeService",
                                                                              "decodeservices")
    assert spec["names"]["shortNames"] == ["dsvc"]
    version = spec["versions"][0]
    assert version["name"] == "v1alpha1" and "status" in version["subresources"] and "scale" in version["subresources"]
    assert [c["name"] for c in version["additionalPrinterColumns"]] == [
        "Ready", "Replicas", "Desired", "Current", "Signal", "TTFT-p95", "SLO", "Age"]
    # HPA and KEDA (autoscaling.mode: external) drive spec.replicas through this subresource.
    assert version["subresources"]["scale"] == {"specReplicasPath": ".spec.replicas",
                                                "statusReplicasPath": ".status.replicas",
                                                "labelSelectorPath": ".status.selector"}

    def walk(schema: dict[str, Any], path: str) -> None:
        assert schema.get("description"), f"{path} has no description"
        for key, sub in (schema.get("properties") or {}).items():
            walk(sub, f"{path}.{key}")
        if "items" in schema and schema["items"].get("type") == "object":
            walk(schema["items"], f"{path}[]")

    walk(version["schema"]["openAPIV3Schema"], "")


@pytest.mark.parametrize("field", ["engine", "model", "rollout"])
def test_crd_schema_matches_the_spec_model(field: str) -> None:
    from decodeservice.operator.spec import DecodeServiceSpec

    schema = open_api_schema()["properties"]["spec"]["properties"][field]
    sub = DecodeServiceSpec.model_fields[field].annotation
    assert isinstance(sub, type) and issubclass(sub, BaseModel)
    assert _schema_fields(schema) == _model_fields(sub)
