"""The desired-objects function: every example and the edge cases, with no server."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from decodeservice.operator.errors import InvalidSpecError
from decodeservice.operator.manifests import (
    ENGINE_DRAIN_SECONDS,
    POLICY_HASH_ANNOTATION,
    PROXY_SHUTDOWN_SECONDS,
    BuildOptions,
    Children,
    render,
)
from tests.operator.helpers import as_pod_templates, example_paths, load, pod_templates
from tests.operator.security import rbac_violations, restricted_violations

K8S_VERSION = "1.37"


def minimal(**spec: Any) -> dict[str, Any]:
    return {"apiVersion": "decode.dev/v1alpha1", "kind": "DecodeService", "metadata": {"name": "m"},
            "spec": {"model": {"uri": "bundled://smollm2-135m"}, **spec}}


def container(children: Children, name: str) -> dict[str, Any]:
    spec = pod_templates(children.workload)[0]["spec"]  # the serving pod (a LeaderWorkerSet's leader)
    return next(c for c in spec["containers"] + spec.get("initContainers", []) if c["name"] == name)


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


@pytest.mark.parametrize("path", example_paths(), ids=lambda p: p.name)
def test_every_example_renders_valid_secure_objects(path: Path) -> None:
    children = render(load(path))
    kinds = [o["kind"] for o in children.all()]
    multi_node = children.workload["spec"].get("leaderWorkerTemplate") is not None
    assert kinds[:3] == ["ConfigMap", "Service", "LeaderWorkerSet" if multi_node else "Deployment"]
    for obj in children.all():
        assert restricted_violations(obj) == [] and rbac_violations(obj) == []
        if obj["kind"] == "InferencePool":
            continue  # a CRD kind, not in kubernetes-validate: test_inference_pool.py checks it upstream's way
        # A LeaderWorkerSet's templates as PodTemplates (test_multinode.py checks the LWS against its CRD).
        for checked in as_pod_templates(obj) if obj is children.workload else [obj]:
            kubernetes_validate.validate(checked, K8S_VERSION, strict=True)
    pod = pod_templates(children.workload)[0]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["engine", "proxy"]
    proxy = container(children, "proxy")
    assert proxy["args"][:3] == ["proxy", "--upstream", "http://127.0.0.1:8001"]
    assert flag(proxy["args"], "--policy") == "/etc/decodeservice/policy.yaml"
    for c in pod["containers"]:
        assert c["readinessProbe"]["httpGet"]["path"] in ("/ready", "/health")
        assert c["livenessProbe"]["httpGet"]["path"] == "/health"
        assert c["lifecycle"]["preStop"]["sleep"]["seconds"] > 0
    assert children.service["spec"]["ports"][0]["port"] == 8000


def test_cpu_smoke_runs_the_bundled_model_without_gpus() -> None:
    children = render(load(example_paths()[0].with_name("cpu-smoke.yaml")))
    engine = container(children, "engine")
    assert engine["command"] == ["decodectl"]
    assert engine["args"][:3] == ["engine", "--model", "smollm2-135m"]
    assert flag(engine["args"], "--device") == "cpu" and flag(engine["args"], "--kv-cache-gib") == "1"
    assert "nvidia.com/gpu" not in engine["resources"]["limits"]
    assert children.pdb is None
    assert "initContainers" not in children.deployment["spec"]["template"]["spec"]


def test_gpu_speculative_downloads_both_models_and_sets_gpu_limits() -> None:
    children = render(load(example_paths()[0].with_name("gpu-speculative.yaml")))
    engine = container(children, "engine")
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert flag(engine["args"], "--speculative-method") == "draft"
    assert flag(engine["args"], "--draft-model") == "/models/hf/Qwen--Qwen2.5-0.5B-Instruct@main"
    fetch = container(children, "fetch-model")
    downloads = json.loads(fetch["command"][-1])
    # Both config.json checks (the builtin engine's), then both snapshots.
    assert [d[3:6] for d in downloads] == [
        ["Qwen/Qwen2.5-1.5B-Instruct", "main", "/models/hf/Qwen--Qwen2.5-1.5B-Instruct@main"],
        ["Qwen/Qwen2.5-0.5B-Instruct", "main", "/models/hf/Qwen--Qwen2.5-0.5B-Instruct@main"]] * 2
    assert {"name": "model-cache", "mountPath": "/models/hf", "readOnly": True} in engine["volumeMounts"]
    assert children.pdb is not None and children.pdb["spec"]["maxUnavailable"] == 1
    # Surge one pod: an old pod serves until its replacement is Ready (spec.rollout can say otherwise).
    assert children.deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}


def test_vllm_renders_the_openai_server_with_equivalent_flags() -> None:
    children = render(load(example_paths()[0].with_name("vllm-proxy.yaml")))
    engine = container(children, "engine")
    assert engine["command"] == ["python3", "-m", "vllm.entrypoints.launchers.api_server.entry"]
    assert engine["image"] == "vllm/vllm-openai:v0.32.0"
    args = engine["args"]
    assert "--enable-prefix-caching" in args
    assert flag(args, "--max-num-seqs") == "128" and flag(args, "--gpu-memory-utilization") == "0.9"
    assert flag(args, "--port") == "8001" and flag(args, "--served-model-name") == "llama-3.1-8b"
    assert json.loads(flag(args, "--speculative-config") or "{}") == {
        "method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    assert args[-2:] == ["--max-model-len", "8192"]
    assert container(children, "proxy")["image"] == BuildOptions().image  # our proxy stays in front


def test_pvc_model_is_mounted_read_only() -> None:
    children = render(minimal(model={"uri": "pvc://models/llama/8b"}))
    pod = children.deployment["spec"]["template"]["spec"]
    assert {"name": "model-pvc", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}} in pod["volumes"]
    engine = container(children, "engine")
    assert flag(engine["args"], "--model") == "/models/pvc/llama/8b"
    assert {"name": "model-pvc", "mountPath": "/models/pvc", "readOnly": True} in engine["volumeMounts"]


def test_file_model_and_served_name_default() -> None:
    engine = container(render(minimal(model={"uri": "file:///opt/weights/tiny-llm"})), "engine")
    assert flag(engine["args"], "--model") == "/opt/weights/tiny-llm"
    assert flag(engine["args"], "--served-model-name") == "tiny-llm"


def test_policy_change_changes_the_pod_template_hash() -> None:
    first = render(minimal())
    second = render(minimal(policies={"slo": {"ttftMs": 250}}))
    assert yaml.safe_load(second.config_map["data"]["policy.yaml"])["slo"]["ttftMs"] == 250
    hashes = [c.deployment["spec"]["template"]["metadata"]["annotations"][POLICY_HASH_ANNOTATION]
              for c in (first, second, render(minimal()))]
    assert hashes[0] != hashes[1] and hashes[0] == hashes[2]


def test_replicas_pdb_and_autoscaling_bounds() -> None:
    assert render(minimal(replicas=1)).pdb is None
    assert render(minimal(replicas=2)).pdb is not None
    scaled = render(minimal(replicas=9, autoscaling={"mode": "builtin", "minReplicas": 2, "maxReplicas": 4}))
    assert scaled.deployment["spec"]["replicas"] == 4
    # One pod now, but the autoscaler may add more before the next reconcile: the budget is there already.
    for mode in ("builtin", "external"):
        one = render(minimal(replicas=1, autoscaling={"mode": mode, "minReplicas": 1, "maxReplicas": 4}))
        assert one.deployment["spec"]["replicas"] == 1 and one.pdb is not None
    assert render(minimal(replicas=1, autoscaling={"mode": "builtin", "maxReplicas": 1})).pdb is None
    assert render(minimal(replicas=0)).deployment["spec"]["replicas"] == 0


def test_node_selector_tolerations_and_extra_args() -> None:
    children = render(minimal(resources={"nodeSelector": {"pool": "gpu"}, "gpus": 1, "tolerations": [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]},
        engine={"extraArgs": ["--seed", "7"], "quantization": "none"}))
    pod = children.deployment["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "gpu"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    engine = container(children, "engine")
    assert engine["args"][-2:] == ["--seed", "7"] and flag(engine["args"], "--quantization") == "none"
    assert flag(engine["args"], "--device") == "cuda" and engine["resources"]["limits"]["nvidia.com/gpu"] == "1"


@pytest.mark.parametrize("field", ["w8a8", "compile", "deterministic"])
def test_engine_switches_reach_the_engine_only_when_asked(field: str) -> None:
    assert f"--{field}" not in container(render(minimal()), "engine")["args"]
    asked = {field: True, "quantization": "int4"}  # compile needs a quantized format
    assert f"--{field}" in container(render(minimal(engine=asked)), "engine")["args"]


def test_the_kv_cache_dtype_reaches_the_builtin_engine_as_its_flag() -> None:
    engine = container(render(minimal(engine={"kvCacheDtype": "int8"})), "engine")
    assert flag(engine["args"], "--kv-cache-dtype") == "int8"


def test_the_inductor_cache_lives_on_the_pods_cache_volume() -> None:
    engine = container(render(minimal(engine={"compile": True, "quantization": "int4"})), "engine")
    cache = {e["name"]: e["value"] for e in engine["env"]}["TORCHINDUCTOR_CACHE_DIR"]
    assert any(cache.startswith(m["mountPath"] + "/") and m["name"] == "cache" for m in engine["volumeMounts"])


def test_build_is_pure_and_options_apply() -> None:
    body = minimal()
    snapshot = copy.deepcopy(body)
    a = render(body, options=BuildOptions(image="example.com/ds:1", drain_seconds=3))
    assert body == snapshot and a == render(body, options=BuildOptions(image="example.com/ds:1", drain_seconds=3))
    assert container(a, "engine")["image"] == "example.com/ds:1"
    assert a.deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 41  # 3 + 1 + 30 + 5 + 2
    with pytest.raises(ValueError, match="drain_seconds"):
        BuildOptions(drain_seconds=-1)


@pytest.mark.parametrize(("body", "message"), [
    (minimal(model={"uri": "bundled://llama-70b"}), "bundles only smollm2-135m"),
    (minimal(engine={"kind": "vllm"}, model={"uri": "hf://org/m"}, resources={"memory": "1Gi"}),
     "too little for vLLM on CPU"),
    (minimal(engine={"kind": "vllm", "quantization": "int8"}, model={"uri": "hf://org/m"}, resources={"gpus": 1}),
     "pre-quantized"),
    (minimal(engine={"quantization": "int4"}, resources={"gpus": 1}), "int4 runs on CPU only"),
    (minimal(engine={"w8a8": True}, resources={"gpus": 1}), "spec.engine.w8a8: runs on the CPU"),
    (minimal(engine={"kind": "vllm", "w8a8": True}, model={"uri": "hf://org/m"}, resources={"gpus": 1}),
     "spec.engine.w8a8: a builtin-engine mode"),
    (minimal(engine={"compile": True}, resources={"gpus": 1}), "spec.engine.compile: compiles the CPU"),
    (minimal(engine={"compile": True}), "spec.engine.compile: needs quantization int4 or int8"),
    (minimal(engine={"compile": True, "quantization": "none"}), "spec.engine.compile: needs quantization"),
    (minimal(engine={"kind": "vllm", "compile": True}, model={"uri": "hf://org/m"}, resources={"gpus": 1}),
     "spec.engine.compile: a builtin-engine mode"),
    (minimal(engine={"kvCacheDtype": "int8"}, resources={"gpus": 1}), "spec.engine.kvCacheDtype: int8 KV pools run"),
    (minimal(engine={"kind": "vllm", "kvCacheDtype": "int8"}, model={"uri": "hf://org/m"}, resources={"gpus": 1}),
     "spec.engine.kvCacheDtype: int8 is a builtin-engine mode"),
    (minimal(engine={"kvCacheDtype": "fp8"}), "kvCacheDtype"),
    (minimal(engine={"deterministic": True}, resources={"gpus": 1}), "spec.engine.deterministic: the builtin"),
    (minimal(engine={"deterministic": True, "w8a8": True}), "spec.engine.deterministic: excludes w8a8"),
    (minimal(engine={"deterministic": True, "compile": True, "quantization": "int4"}),
     "spec.engine.deterministic: excludes compile"),
    (minimal(engine={"deterministic": "sometimes"}), "deterministic"),
    (minimal(engine={"gpuMemoryFraction": 0.5}), "needs resources.gpus > 0"),
    (minimal(model={"uri": "pvc://a/m"}, engine={"speculative": {"method": "draft", "draftModel": "pvc://b/d"}}),
     "must live on the model's claim"),
    (minimal(unknown=1), "unknown field"),
    ({**minimal(), "metadata": {"name": "Bad_Name"}}, "DNS-1035"),
    ({**minimal(), "kind": "Deployment"}, "kind DecodeService"),
])
def test_invalid_specs_are_rejected_with_the_field_named(body: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidSpecError, match=message):
        render(body)


@pytest.mark.parametrize("options", [BuildOptions(), BuildOptions(drain_seconds=0, proxy_drain_timeout_seconds=120)])
def test_termination_grace_covers_the_proxy_and_engine_drains(options: BuildOptions) -> None:
    # A pod removed by a scale-down must finish its streams: preStop, then the drain after SIGTERM, then
    # uvicorn's graceful shutdown, all inside the grace period, or the kubelet cuts streams with SIGKILL.
    children = render(minimal(), options=options)
    pod = children.deployment["spec"]["template"]["spec"]
    proxy, engine = container(children, "proxy"), container(children, "engine")
    proxy_drain = int(flag(proxy["args"], "--drain-timeout-seconds") or 0)
    assert proxy_drain == options.proxy_drain_timeout_seconds
    proxy_needs = proxy["lifecycle"]["preStop"]["sleep"]["seconds"] + proxy_drain + PROXY_SHUTDOWN_SECONDS
    engine_needs = engine["lifecycle"]["preStop"]["sleep"]["seconds"] + ENGINE_DRAIN_SECONDS + PROXY_SHUTDOWN_SECONDS
    assert pod["terminationGracePeriodSeconds"] > max(proxy_needs, engine_needs)
    with pytest.raises(ValueError, match="proxy_drain_timeout_seconds"):
        BuildOptions(proxy_drain_timeout_seconds=0)


def test_engine_drain_default_is_the_one_the_grace_period_assumes() -> None:
    from decodeservice.engine.server.settings import ServerSettings
    assert ServerSettings.__dataclass_fields__["drain_timeout_s"].default == ENGINE_DRAIN_SECONDS
