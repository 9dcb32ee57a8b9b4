"""Issue 25's faults in what the operator renders for a production cluster, each with the fix's test."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
import yaml

from decodeservice.operator.errors import InvalidSpecError
from decodeservice.operator.manifests import DEFAULT_CUDA_IMAGE, DEFAULT_IMAGE, BuildOptions, Children, render
from tests.operator.helpers import CHART, ROOT, example_paths, load
from tests.operator.schema import validate

K8S_VERSION = "1.37"


def minimal(**spec: Any) -> dict[str, Any]:
    return {"apiVersion": "decode.dev/v1alpha1", "kind": "DecodeService", "metadata": {"name": "m"},
            "spec": {"model": {"uri": "bundled://smollm2-135m"}, **spec}}


def vllm(**spec: Any) -> dict[str, Any]:
    body = minimal(**spec)
    body["spec"]["model"] = {"uri": "hf://org/model"}
    body["spec"].setdefault("resources", {})["gpus"] = body["spec"].get("resources", {}).get("gpus", 1)
    body["spec"]["engine"] = {"kind": "vllm", **body["spec"].get("engine", {})}
    return body


def pod(children: Children) -> dict[str, Any]:
    spec: dict[str, Any] = children.deployment["spec"]["template"]["spec"]
    return spec


def container(children: Children, name: str) -> dict[str, Any]:
    spec = pod(children)
    return next(c for c in spec["containers"] + spec.get("initContainers", []) if c["name"] == name)


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def test_the_proxy_asks_the_engines_own_readiness_route() -> None:
    # vLLM has no /ready: the proxy must ask /health of it, or the pod is never Ready.
    assert flag(container(render(vllm()), "proxy")["args"], "--engine-kind") == "vllm"
    assert flag(container(render(minimal()), "proxy")["args"], "--engine-kind") == "builtin"


@pytest.mark.parametrize("gpus", [0, 1])
def test_a_one_replica_service_keeps_serving_through_a_rollout(gpus: int) -> None:
    body = minimal(replicas=1, resources={"gpus": gpus}, engine={"quantization": "none"} if gpus else {})
    strategy = render(body).deployment["spec"]["strategy"]
    assert strategy == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}


def test_a_quota_bound_cluster_can_replace_in_place() -> None:
    body = minimal(rollout={"maxSurge": 0, "maxUnavailable": 1})
    assert validate(body) == []
    assert render(body).deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    stuck = minimal(rollout={"maxSurge": 0, "maxUnavailable": 0})
    assert any("cannot both be 0" in e for e in validate(stuck))
    with pytest.raises(InvalidSpecError, match="spec.rollout: maxSurge and maxUnavailable cannot both be 0"):
        render(stuck)


def test_builtin_with_several_gpus_says_to_use_vllm() -> None:
    with pytest.raises(InvalidSpecError, match="no tensor parallelism.*engine.kind vllm"):
        render(minimal(resources={"gpus": 4}, engine={"quantization": "none"}))
    engine = container(render(vllm(resources={"gpus": 4})), "engine")
    assert flag(engine["args"], "--tensor-parallel-size") == "4"


def test_vllm_keeps_its_own_defaults() -> None:
    # The CRD used to default maxNumSeqs to 16 and pass it to vLLM (and 0.9 memory): now only what is set.
    args = container(render(vllm()), "engine")["args"]
    assert "--max-num-seqs" not in args and "--gpu-memory-utilization" not in args
    args = container(render(vllm(engine={"maxNumSeqs": 96, "gpuMemoryFraction": 0.8})), "engine")["args"]
    assert flag(args, "--max-num-seqs") == "96" and flag(args, "--gpu-memory-utilization") == "0.8"


def _floor(version: str) -> tuple[int, int]:
    major, minor = version.removeprefix(">=").split("-")[0].split(".")[:2]
    return int(major), int(minor)


def test_the_chart_floor_allows_the_rendered_prestop_form() -> None:
    floor = _floor(yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"])
    for path in example_paths():
        for c in pod(render(load(path)))["containers"]:
            if "sleep" in c["lifecycle"]["preStop"]:
                assert floor >= (1, 30), "preStop.sleep needs Kubernetes 1.30 (PodLifecycleSleepAction)"
        for obj in render(load(path)).all():
            if obj["kind"] != "InferencePool":
                kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_gpu_pods_run_the_cuda_image_and_the_rest_the_cpu_one() -> None:
    gpu = render(minimal(model={"uri": "hf://org/m"}, resources={"gpus": 1}, engine={"quantization": "none"}))
    assert container(gpu, "engine")["image"] == BuildOptions().cuda_image == DEFAULT_CUDA_IMAGE
    assert container(gpu, "proxy")["image"] == container(gpu, "fetch-model")["image"] == DEFAULT_IMAGE
    assert container(render(minimal()), "engine")["image"] == DEFAULT_IMAGE
    own = BuildOptions(image="r/ds:1", cuda_image="r/ds:1-cu")
    assert container(render(minimal(resources={"gpus": 1}, engine={"quantization": "none"}), options=own),
                     "engine")["image"] == "r/ds:1-cu"
    pinned = minimal(resources={"gpus": 1}, engine={"quantization": "none", "image": "r/mine:2"})
    assert container(render(pinned), "engine")["image"] == "r/mine:2"  # engine.image overrides the pick


def test_the_dockerfile_builds_both_images_the_operator_names() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert 'index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}"' in text
    assert f"--build-arg TORCH_VARIANT=cpu   -t {DEFAULT_IMAGE} ." in text
    assert f"--build-arg TORCH_VARIANT=cu128 -t {DEFAULT_CUDA_IMAGE} ." in text
