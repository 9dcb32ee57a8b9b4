"""Faults once found in what the operator renders for a production cluster, each with the fix's test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from decodeservice.operator.engines import COMPLETE_MARKER, HF_DOWNLOAD
from decodeservice.operator.errors import InvalidSpecError
from decodeservice.operator.manifests import DEFAULT_CUDA_IMAGE, DEFAULT_IMAGE, BuildOptions, Children, render
from tests.operator.helpers import CHART, ROOT, as_pod_templates, example_paths, load, pod_templates
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
        children = render(load(path))
        for template in pod_templates(children.workload):
            for c in template["spec"]["containers"]:
                if "sleep" in (c.get("lifecycle") or {}).get("preStop", {}):
                    assert floor >= (1, 30), "preStop.sleep needs Kubernetes 1.30 (PodLifecycleSleepAction)"
        for obj in children.all():
            if obj["kind"] != "InferencePool":
                for checked in as_pod_templates(obj):  # a LeaderWorkerSet's templates as PodTemplates
                    kubernetes_validate.validate(checked, K8S_VERSION, strict=True)


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


def hf(model: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    body = minimal(**spec)
    body["spec"]["model"] = {"uri": "hf://meta-llama/Llama-3.1-8B-Instruct@abc123", **(model or {})}
    return body


def test_gated_models_get_the_token_for_their_download() -> None:
    body = hf(model={"tokenSecret": {"name": "hf-token"}})
    assert validate(body) == []
    children = render(body)
    fetch, engine = container(children, "fetch-model"), container(children, "engine")
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}} in fetch["env"]
    assert all(e["name"] != "HF_TOKEN" for e in engine["env"])  # the engine reads local files only
    kubernetes_validate.validate(children.deployment, K8S_VERSION, strict=True)
    with pytest.raises(InvalidSpecError, match="tokenSecret: only hf:// models are downloaded"):
        render(minimal(model={"uri": "bundled://smollm2-135m", "tokenSecret": {"name": "hf-token"}}))
    assert any("does not match" in e for e in validate(hf(model={"tokenSecret": {"name": "Bad_Name"}})))


def test_engine_env_and_env_from_reach_the_engine_container() -> None:
    env = [{"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"},
           {"name": "API_KEY", "valueFrom": {"secretKeyRef": {"name": "keys", "key": "engine"}}},
           {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    env_from = [{"secretRef": {"name": "engine-secrets"}}, {"configMapRef": {"name": "tuning"}, "prefix": "T_"}]
    body = minimal(engine={"env": env, "envFrom": env_from})
    assert validate(body) == []
    children = render(body)
    engine = container(children, "engine")
    assert engine["env"][-3:] == env and engine["envFrom"] == env_from
    kubernetes_validate.validate(children.deployment, K8S_VERSION, strict=True)


@pytest.mark.parametrize(("engine", "message"), [
    ({"env": [{"name": "HOME", "value": "/root"}]}, r"env\[0\].name: HOME is set by the operator"),
    ({"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]}, "given twice"),
    ({"env": [{"name": "1A", "value": "x"}]}, "should match pattern"),
    ({"env": [{"name": "A", "value": "x", "valueFrom": {"fieldRef": {"fieldPath": "x"}}}]}, "exclusive"),
    ({"env": [{"name": "A", "valueFrom": {}}]}, "exactly one"),
    ({"envFrom": [{"prefix": "P_"}]}, "exactly one of secretRef and configMapRef"),
    ({"env": [{"name": "A", "valueFrom": {"secretKeyRef": {"name": "s"}}}]}, "key"),
])
def test_bad_env_is_an_invalid_spec(engine: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidSpecError, match=message):
        render(minimal(engine=engine))


# A Llama repo as the hub lists it: original/ holds a second, .pth copy of the weights nobody loads.
LLAMA_FILES = ["config.json", "generation_config.json", "model-00001-of-00004.safetensors",
               "model-00004-of-00004.safetensors", "model.safetensors.index.json", "special_tokens_map.json",
               "tokenizer.json", "tokenizer_config.json", "LICENSE", "README.md", "USE_POLICY.md",
               "original/consolidated.00.pth", "original/params.json", "original/tokenizer.model"]


@pytest.mark.parametrize("kind", ["builtin", "vllm"])
def test_downloads_fetch_only_what_the_engine_reads(kind: str) -> None:
    from huggingface_hub.utils import filter_repo_objects  # what snapshot_download filters the listing with

    body = hf(resources={"gpus": 1}, engine={"kind": kind, "quantization": "none" if kind == "builtin" else "auto"})
    command = json.loads(container(render(body), "fetch-model")["command"][-1])[-1]  # builtin: after its check
    allow, ignore = json.loads(command[-2]), json.loads(command[-1])
    fetched = set(filter_repo_objects(LLAMA_FILES, allow_patterns=allow, ignore_patterns=ignore))
    assert not any(f.startswith("original/") or f.endswith(".pth") for f in fetched)
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "model-00001-of-00004.safetensors"} <= fetched


def _download(target: Path, revision: str) -> subprocess.CompletedProcess[str]:
    # Offline: nothing leaves the machine.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(target.parent / "hf-home")}
    return subprocess.run([sys.executable, "-c", HF_DOWNLOAD, "org/m", revision, str(target), '["*.json"]', "[]"],
                          capture_output=True, text=True, timeout=60, env=env)


def test_a_finished_download_is_not_repeated(tmp_path: Path) -> None:
    target = tmp_path / "org--m@abc"
    target.mkdir()
    (target / COMPLETE_MARKER).write_text("abc")
    done = _download(target, "abc")
    assert done.returncode == 0 and "in the model cache" in done.stdout, done.stderr
    # Another revision is fetched (offline, snapshot_download settles for the local folder) and recorded.
    other = _download(target, "def")
    assert "in the model cache" not in other.stdout and (target / COMPLETE_MARKER).read_text() == "def"


def test_a_pvc_cache_is_shared_and_engines_mount_it_read_only() -> None:
    children = render(hf(model={"cache": {"claimName": "models-rwx"}}))
    volumes = {v["name"]: v for v in pod(children)["volumes"]}
    assert volumes["model-cache"] == {"name": "model-cache", "persistentVolumeClaim": {"claimName": "models-rwx"}}
    fetch_mount = next(m for m in container(children, "fetch-model")["volumeMounts"] if m["name"] == "model-cache")
    engine_mount = next(m for m in container(children, "engine")["volumeMounts"] if m["name"] == "model-cache")
    assert not fetch_mount.get("readOnly") and engine_mount["readOnly"] is True
    assert "ephemeral-storage" not in container(children, "engine")["resources"]["requests"]
    with pytest.raises(InvalidSpecError, match="cache.claimName: only hf:// downloads"):
        render(minimal(model={"uri": "bundled://smollm2-135m", "cache": {"claimName": "c"}}))


@pytest.mark.parametrize(("cache", "size"), [({}, "50Gi"), ({"sizeLimit": "200Gi"}, "200Gi")])
def test_the_per_pod_download_is_bounded_and_requested(cache: dict[str, str], size: str) -> None:
    children = render(hf(model={"cache": cache}))
    volumes = {v["name"]: v for v in pod(children)["volumes"]}
    assert volumes["model-cache"]["emptyDir"] == {"sizeLimit": size}
    assert container(children, "engine")["resources"]["requests"]["ephemeral-storage"] == size
    kubernetes_validate.validate(children.deployment, K8S_VERSION, strict=True)


POD = {
    "labels": {"team": "search", "example.com/cost-center": "ml-42"},
    "annotations": {"example.com/owner": "search@example.com"},
    "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "nvidia.com/gpu.product", "operator": "In", "values": ["NVIDIA-H100-80GB-HBM3"]}]}]}},
        "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 50, "podAffinityTerm": {
            "topologyKey": "kubernetes.io/hostname",
            "labelSelector": {"matchLabels": {"app.kubernetes.io/instance": "m"}}}}]}},
    "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
                                   "whenUnsatisfiable": "ScheduleAnyway"}],
    "runtimeClassName": "nvidia",
    "priorityClassName": "inference-high",
    "imagePullSecrets": [{"name": "registry"}],
}


def test_pod_template_passthrough_reaches_the_pods() -> None:
    body = minimal(pod=POD)
    assert validate(body) == []
    children = render(body)
    spec, meta = pod(children), children.deployment["spec"]["template"]["metadata"]
    assert spec["affinity"] == POD["affinity"]
    assert spec["topologySpreadConstraints"] == [{**POD["topologySpreadConstraints"][0], "labelSelector": {
        "matchLabels": children.deployment["spec"]["selector"]["matchLabels"]}}]
    assert (spec["runtimeClassName"], spec["priorityClassName"]) == ("nvidia", "inference-high")
    assert spec["imagePullSecrets"] == [{"name": "registry"}]
    assert meta["labels"]["team"] == "search" and meta["labels"]["app.kubernetes.io/instance"] == "m"
    assert meta["annotations"]["example.com/owner"] == "search@example.com"
    assert "decode.dev/policy-hash" in meta["annotations"]
    kubernetes_validate.validate(children.deployment, K8S_VERSION, strict=True)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("labels", {"app.kubernetes.io/instance": "other"}, "prefixes are the operator's"),
    ("labels", {"team": "not a value"}, "is not a label value"),
    ("annotations", {"prometheus.io/port": "9999"}, "operator sets the prometheus.io/"),
    ("annotations", {"bad key!": "x"}, "the name must be"),
    ("affinity", {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "k", "operator": "Near"}]}]}}}, "operator"),
    ("affinity", {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "k", "operator": "In"}]}]}}}, "takes some values"),
    ("affinity", {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{"labelSelector": {}}]}},
     "topologyKey"),
    ("affinity", {"nodeAfinity": {}}, "unknown field"),
    ("topologySpreadConstraints", [{"maxSkew": 0, "topologyKey": "z", "whenUnsatisfiable": "DoNotSchedule"}],
     "greater than or equal to 1"),
    ("topologySpreadConstraints", [{"maxSkew": 1, "topologyKey": "z", "whenUnsatisfiable": "Maybe"}],
     "should match pattern"),
    ("runtimeClassName", "NVIDIA", "should match pattern"),
    ("imagePullSecrets", [{}], "name"),
])
def test_bad_pod_fields_are_invalid_specs(field: str, value: Any, message: str) -> None:
    with pytest.raises(InvalidSpecError, match=message):
        render(minimal(pod={field: value}))
