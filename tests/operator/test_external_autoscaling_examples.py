"""autoscaling.mode: external: the KEDA and HPA examples validate, target the external-mode example
DecodeService through its scale subresource, and scale on metric names the proxy really exports."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from decodeservice.operator.manifests import render
from tests.operator.helpers import EXAMPLES, load
from tests.operator.schema import validate

K8S_VERSION = "1.37"
KEDA_CRD = Path(__file__).parent / "schemas" / "keda.sh_scaledobjects.yaml"
METRICS_MD = Path(__file__).resolve().parents[2] / "proxy" / "METRICS.md"
KEDA = EXAMPLES / "autoscaling" / "keda-scaledobject.yaml"
HPA = EXAMPLES / "autoscaling" / "hpa-custom-metric.yaml"
TARGET = EXAMPLES / "external-autoscaling.yaml"


def _structural(schema: Any) -> Any:
    """The CRD's OpenAPI schema as JSON schema, as strict as `kubectl apply --validate=strict`: fields the
    schema does not declare are errors (the API server would prune or reject them)."""
    if isinstance(schema, list):
        return [_structural(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _structural(v) for k, v in schema.items() if not k.startswith("x-kubernetes-")}
    if schema.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if schema.get("type") == "object" and "properties" in schema and "additionalProperties" not in schema \
            and not schema.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def keda_errors(obj: dict[str, Any]) -> list[str]:
    crd = load(KEDA_CRD)
    version = next(v for v in crd["spec"]["versions"] if v["name"] == obj["apiVersion"].split("/")[1])
    schema = version["schema"]["openAPIV3Schema"]
    validator = jsonschema.Draft4Validator(_structural(schema))
    errors = [f"{'.'.join(str(p) for p in e.absolute_path)}: {e.message}" for e in validator.iter_errors(obj)]
    # The CRD's one CEL rule on spec, by hand (its text is checked so a new rule is not missed).
    rules = [r["rule"] for r in schema["properties"]["spec"].get("x-kubernetes-validations", [])]
    assert rules == ["!has(self.minReplicaCount) || self.minReplicaCount <= (has(self.maxReplicaCount) "
                     "? self.maxReplicaCount : 100)"]
    spec = obj["spec"]
    if "minReplicaCount" in spec and spec["minReplicaCount"] > spec.get("maxReplicaCount", 100):
        errors.append("spec: minReplicaCount must be less than or equal to maxReplicaCount")
    return errors


def _documented_metrics() -> set[str]:
    return set(re.findall(r"^\| `((?:decode_proxy|vllm):[a-z0-9_]+)`", METRICS_MD.read_text(), flags=re.M))


def test_the_target_is_an_external_mode_decodeservice() -> None:
    target = load(TARGET)
    assert validate(target) == []
    assert target["spec"]["autoscaling"]["mode"] == "external"
    render(target)  # `decodectl render` accepts it


def test_keda_scaledobject_validates_against_the_vendored_crd() -> None:
    obj = load(KEDA)
    assert keda_errors(obj) == []
    assert obj["spec"]["triggers"] and all(t["type"] == "prometheus" for t in obj["spec"]["triggers"])


def test_keda_validation_catches_mistakes() -> None:
    obj = load(KEDA)
    obj["spec"]["triggers"][0]["metadata"]["threshold"] = 12  # trigger metadata values are strings
    obj["spec"]["minReplicaCount"] = 9
    obj["spec"]["scaleTargetRef"]["kind_"] = "typo"
    errors = keda_errors(obj)
    assert any("12 is not of type 'string'" in e for e in errors), errors
    assert any("minReplicaCount must be less" in e for e in errors), errors
    assert any("kind_" in e for e in errors), errors


def test_hpa_validates_with_kubernetes_validate() -> None:
    obj = load(HPA)
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    broken = load(HPA)
    broken["spec"]["metrics"][0]["pods"]["target"]["type"] = 7
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


@pytest.mark.parametrize("path", [KEDA, HPA], ids=lambda p: p.name)
def test_scalers_target_the_decodeservice_scale_subresource_within_its_bounds(path: Path) -> None:
    obj, target = load(path), load(TARGET)
    ref = obj["spec"]["scaleTargetRef"]
    assert (ref["apiVersion"], ref["kind"], ref["name"]) == ("decode.dev/v1alpha1", "DecodeService",
                                                              target["metadata"]["name"])
    spec = obj["spec"]
    low = spec.get("minReplicas", spec.get("minReplicaCount"))
    high = spec.get("maxReplicas", spec.get("maxReplicaCount"))
    # The operator clamps spec.replicas to the DecodeService's own bounds: they must not be narrower.
    bounds = target["spec"]["autoscaling"]
    assert bounds["minReplicas"] <= low and high <= bounds["maxReplicas"]


def test_the_scalers_use_metric_names_the_proxy_exports() -> None:
    documented = _documented_metrics()
    keda = " ".join(t["metadata"]["query"] for t in load(KEDA)["spec"]["triggers"])
    used = set(re.findall(r"((?:decode_proxy|vllm):[a-z0-9_]+)", keda))
    assert used and {re.sub(r"_bucket$", "", n) for n in used} <= documented
    # prometheus-adapter exposes decode_proxy:NAME as decode_proxy_NAME (the rule in the HPA's comment).
    hpa = [m["pods"]["metric"]["name"] for m in load(HPA)["spec"]["metrics"]]
    assert hpa and {n.replace("decode_proxy_", "decode_proxy:", 1) for n in hpa} <= documented
    assert "decode_proxy_num_requests_${1}" in HPA.read_text()


def test_examples_are_single_documents() -> None:
    for path in (KEDA, HPA):
        assert len([d for d in yaml.safe_load_all(path.read_text()) if d]) == 1
