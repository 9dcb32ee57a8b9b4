"""The DecodeService's cross-field rules, each written once: its CEL text (the CRD's
`x-kubernetes-validations`, run by the API server) beside its Python twin (run by the operator, which
must not trust that a server enforced them: an older server, a test emulator, `decodectl render`).

scripts/generate_crd.py writes the spec.engine rules into the CRD from this table; tests/operator/test_crd.py
checks that the CRD carries exactly these rules and that a CEL evaluator agrees with each twin.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class CelRule:
    """One `x-kubernetes-validations` rule: where it sits, its CEL text, and its Python twin."""

    path: tuple[str, ...]  # property names from `spec` down to the object the rule is attached to
    rule: str
    message: str
    check: Callable[[Mapping[str, Any]], bool]  # takes the (defaulted) object at `path`


CEL_RULES: tuple[CelRule, ...] = (
    CelRule(path=("engine",), rule="!(has(self.kvCacheGiB) && has(self.gpuMemoryFraction))",
            message="set kvCacheGiB or gpuMemoryFraction, not both",
            check=lambda o: not ("kvCacheGiB" in o and "gpuMemoryFraction" in o)),
    CelRule(path=("engine", "speculative"), rule="self.method != 'draft' || has(self.draftModel)",
            message="draftModel is required when method is draft",
            check=lambda o: o.get("method") != "draft" or "draftModel" in o),
    CelRule(path=("engine", "speculative"), rule="!has(self.draftModel) || self.method == 'draft'",
            message="draftModel is only used when method is draft",
            check=lambda o: "draftModel" not in o or o.get("method") == "draft"),
    CelRule(path=("autoscaling",), rule="self.minReplicas <= self.maxReplicas",
            message="minReplicas must be <= maxReplicas",
            check=lambda o: int(o.get("minReplicas", 1)) <= int(o.get("maxReplicas", 1))),
    CelRule(path=("autoscaling",),
            rule="!has(self.scaleDownThreshold) || !has(self.scaleUpThreshold) "
                 "|| self.scaleDownThreshold < self.scaleUpThreshold",
            message="scaleDownThreshold must be < scaleUpThreshold",
            check=lambda o: ("scaleDownThreshold" not in o or "scaleUpThreshold" not in o
                             or float(o["scaleDownThreshold"]) < float(o["scaleUpThreshold"]))),
    CelRule(path=("autoscaling",),
            rule="!has(self.panicWindowSeconds) || !has(self.stableWindowSeconds) "
                 "|| self.panicWindowSeconds <= self.stableWindowSeconds",
            message="panicWindowSeconds must be <= stableWindowSeconds",
            check=lambda o: ("panicWindowSeconds" not in o or "stableWindowSeconds" not in o
                             or float(o["panicWindowSeconds"]) <= float(o["stableWindowSeconds"]))),
    CelRule(path=(), rule="self.engine.kind != 'vllm' || self.engine.speculative.method != 'self_draft'",
            message="the vllm engine does not support self_draft speculation",
            check=lambda o: o["engine"]["kind"] != "vllm" or o["engine"]["speculative"]["method"] != "self_draft"),
    CelRule(path=(), rule="self.engine.kind != 'vllm' || !self.model.uri.startsWith('bundled://')",
            message="bundled:// models are served by the builtin engine only",
            check=lambda o: o["engine"]["kind"] != "vllm" or not str(o["model"]["uri"]).startswith("bundled://")),
    CelRule(path=(), rule="self.resources.nodes == 1 || self.engine.kind == 'vllm'",
            message="multi-node serving (resources.nodes > 1) needs engine.kind: vllm (the builtin engine runs "
                    "on one device)",
            check=lambda o: int(o["resources"]["nodes"]) == 1 or o["engine"]["kind"] == "vllm"),
    CelRule(path=(), rule="self.autoscaling.minReplicas != 0 || !has(self.routing.mode) || self.routing.mode == 'router'",
            message="autoscaling.minReplicas: 0 needs routing.mode router (only the router holds requests while "
                    "no replica is ready)",
            check=lambda o: (int(o["autoscaling"]["minReplicas"]) != 0 or "mode" not in o["routing"]
                             or o["routing"]["mode"] == "router")),
    CelRule(path=("routing",),
            rule="!has(self.mode) || self.mode == 'inferencePool' || !self.inferencePool.enabled",
            message="inferencePool.enabled (the older spelling of mode inferencePool) conflicts with any other mode",
            check=lambda o: ("mode" not in o or o["mode"] == "inferencePool"
                             or not o.get("inferencePool", {}).get("enabled", False))),
    CelRule(path=("routing",),
            rule="!has(self.mode) || self.mode != 'inferencePool' || has(self.inferencePool.endpointPickerRef)",
            message="mode inferencePool needs inferencePool.endpointPickerRef (the pool's endpoint picker)",
            check=lambda o: o.get("mode") != "inferencePool" or "endpointPickerRef" in o.get("inferencePool", {})),
    CelRule(path=("routing", "inferencePool"), rule="!self.enabled || has(self.endpointPickerRef)",
            message="endpointPickerRef is required when the inference pool is enabled",
            check=lambda o: not o.get("enabled", False) or "endpointPickerRef" in o),
    # Upstream's own rule on InferencePool.spec.endpointPickerRef, checked here before the pool is rendered.
    CelRule(path=("routing", "inferencePool", "endpointPickerRef"), rule="self.kind != 'Service' || has(self.port)",
            message="port is required when kind is 'Service' or unspecified (defaults to 'Service')",
            check=lambda o: o.get("kind", "Service") != "Service" or "port" in o),
    CelRule(path=("rollout",), rule="self.maxSurge > 0 || self.maxUnavailable > 0",
            message="maxSurge and maxUnavailable cannot both be 0 (the rollout could never replace a pod)",
            check=lambda o: int(o.get("maxSurge", 1)) > 0 or int(o.get("maxUnavailable", 0)) > 0),
    CelRule(path=("policies", "outputLength"), rule="self.defaultMaxTokens <= self.maxOutputTokens",
            message="defaultMaxTokens must be <= maxOutputTokens",
            check=lambda o: int(o.get("defaultMaxTokens", 256)) <= int(o.get("maxOutputTokens", 2048))),
)
