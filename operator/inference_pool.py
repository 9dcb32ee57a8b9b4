"""The Gateway API Inference Extension's InferencePool for a DecodeService (opt-in: spec.routing.inferencePool).

An InferencePool (`inference.networking.k8s.io/v1`) tells a Gateway which pods serve a model; its
endpoint picker (EPP) scrapes each pod's `/metrics` on the pool's target port and routes every request
to the least loaded pod. llm-d and KServe users route this way.

- selector: the Deployment's own selector labels (name + instance); for a multi-node service, those
  plus `decode.dev/role: leader` (manifests.serving_selector: only leaders run the proxy). They never
  change with the rest of the spec, so a rollout keeps every pod in the pool, and they never include
  `pod-template-hash`, which differs per ReplicaSet.
- targetPorts: the proxy's port only. The picker must see the proxy's view of each pod (the proxy sheds
  and queues in front of the engine), and requests must go through the proxy's SLO policies. The proxy
  relays the engine's `vllm:*` series on that port (the picker reads `vllm:num_requests_waiting`,
  `vllm:num_requests_running`, `vllm:kv_cache_usage_perc`); that relay is the proxy's part.
- endpointPickerRef: copied from the user's fields (the upstream shape, field for field).
- Pods are labelled `llm-d.ai/engine-type: vllm`, which llm-d's picker configs select on: both engines
  export the vLLM metric names.
"""

from __future__ import annotations

from typing import Any

from decodeservice.operator.engines import PROXY_PORT
from decodeservice.operator.routing_spec import RoutingMode
from decodeservice.operator.spec import ValidatedSpec

API_VERSION = "inference.networking.k8s.io/v1"
ENGINE_TYPE_LABEL = "llm-d.ai/engine-type"
ENGINE_TYPE = "vllm"


def enabled(v: ValidatedSpec) -> bool:
    """routing.mode inferencePool, or its older spelling inferencePool.enabled (spec.routing_mode decides)."""
    return v.routing is RoutingMode.INFERENCE_POOL


def pod_labels(v: ValidatedSpec) -> dict[str, str]:
    """Labels the pods gain when the pool is on (none when it is off)."""
    return {ENGINE_TYPE_LABEL: ENGINE_TYPE} if enabled(v) else {}


def build_inference_pool(*, name: str, namespace: str, v: ValidatedSpec, labels: dict[str, str],
                         selector: dict[str, str]) -> dict[str, Any] | None:
    pool = v.spec.routing.inference_pool
    if not enabled(v):
        return None
    # validate_spec guarantees the reference in this mode (routing_spec.routing_mode, and a CEL rule).
    assert pool.endpoint_picker_ref is not None
    return {
        "apiVersion": API_VERSION, "kind": "InferencePool",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels)},
        "spec": {
            "selector": {"matchLabels": dict(selector)},
            "targetPorts": [{"number": PROXY_PORT}],
            "endpointPickerRef": pool.endpoint_picker_ref.model_dump(mode="json", by_alias=True, exclude_none=True),
        },
    }

