"""engine.kind vllm as the operator renders it: the CPU build with resources.gpus 0, and only flags (and the
server module) that every recorded vLLM release in the supported window accepts."""

from __future__ import annotations

from typing import Any

import pytest

from decodeservice.operator.errors import DeterministicUnsupportedError, InvalidSpecError
from decodeservice.operator.manifests import DEFAULT_VLLM_CPU_IMAGE, DEFAULT_VLLM_IMAGE, render
from tests.operator.helpers import pod_templates
from tests.support.vllm_standin import LATEST, VERSIONS, Contract


def _vllm(*, resources: dict[str, Any], engine: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"apiVersion": "decode.dev/v1alpha1", "kind": "DecodeService", "metadata": {"name": "v"},
            "spec": {"model": {"uri": "hf://org/model"}, "engine": {"kind": "vllm", **(engine or {})},
                     "resources": resources}}


def _engine(body: dict[str, Any]) -> dict[str, Any]:
    spec = pod_templates(render(body).workload)[0]["spec"]
    return next(c for c in spec["containers"] if c["name"] == "engine")


def _flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def test_gpus_0_renders_vllms_cpu_build_with_a_kv_cache_from_the_memory_request() -> None:
    engine = _engine(_vllm(resources={"gpus": 0, "cpu": "4", "memory": "16Gi"}))
    assert engine["image"] == DEFAULT_VLLM_CPU_IMAGE
    assert _flag(engine["args"], "--kv-cache-memory-bytes") == str(8 << 30)  # half the request
    assert "--gpu-memory-utilization" not in engine["args"] and "nvidia.com/gpu" not in engine["resources"]["limits"]
    given = _engine(_vllm(resources={"gpus": 0, "memory": "16Gi"}, engine={"kvCacheGiB": 2.5}))
    assert _flag(given["args"], "--kv-cache-memory-bytes") == str(int(2.5 * (1 << 30)))
    gpu = _engine(_vllm(resources={"gpus": 1, "memory": "48Gi"}))
    assert gpu["image"] == DEFAULT_VLLM_IMAGE and "--kv-cache-memory-bytes" not in gpu["args"]


@pytest.mark.parametrize(("resources", "engine", "message"), [
    ({"gpus": 0, "memory": "1Gi"}, None, "too little for vLLM on CPU"),
    ({"gpus": 0, "memory": "4Gi"}, {"kvCacheGiB": 4}, "leaves nothing of resources.memory 4Gi"),
    ({"gpus": 0, "memory": "8Gi"}, {"gpuMemoryFraction": 0.5}, "needs resources.gpus > 0"),
    ({"gpus": 1, "memory": "8Gi"}, {"kvCacheGiB": 2}, "on GPUs the vllm engine sizes its cache"),
])
def test_what_vllm_on_cpu_cannot_take_is_refused(resources: dict[str, Any], engine: dict[str, Any] | None,
                                                 message: str) -> None:
    with pytest.raises(InvalidSpecError, match=message):
        render(_vllm(resources=resources, engine=engine))


def test_the_default_image_is_the_newest_recorded_release() -> None:
    assert DEFAULT_VLLM_IMAGE.endswith(f":v{LATEST}") and DEFAULT_VLLM_CPU_IMAGE.endswith(f":v{LATEST}")


@pytest.mark.parametrize("version", VERSIONS)
def test_every_rendered_flag_is_one_the_release_accepts(version: str) -> None:
    cli = Contract.load(version).data["cli"]
    bodies = [
        _vllm(resources={"gpus": 0, "memory": "16Gi"}, engine={"maxNumSeqs": 8, "speculative": {
            "method": "ngram", "numTokens": 4}}),
        _vllm(resources={"gpus": 2, "memory": "48Gi"}, engine={"gpuMemoryFraction": 0.8}),
        _vllm(resources={"gpus": 8, "nodes": 2, "memory": "480Gi"}),
    ]
    for body in bodies:
        engine = _engine(body)
        flags = {a for a in engine["args"] if a.startswith("--")}
        assert flags <= set(cli["flags"]), (version, sorted(flags - set(cli["flags"])))
        assert cli["server_module"] in " ".join(engine["command"])


@pytest.mark.parametrize("version", VERSIONS)
def test_no_recorded_release_takes_a_batch_invariance_flag(version: str) -> None:
    # Why engine.deterministic is refused for vLLM below: its batch invariance is an environment variable
    # (VLLM_BATCH_INVARIANT, GPUs), and no recorded release's command line has a switch for it. A release
    # recorded with one fails this test: render that flag for it then.
    flags = Contract.load(version).data["cli"]["flags"]
    assert [f for f in flags if "invarian" in f or "determinis" in f] == []


@pytest.mark.parametrize("resources", [{"gpus": 0, "memory": "16Gi"}, {"gpus": 1, "memory": "48Gi"}])
def test_deterministic_with_vllm_is_refused_with_its_own_reason(resources: dict[str, Any]) -> None:
    with pytest.raises(DeterministicUnsupportedError, match="VLLM_BATCH_INVARIANT") as caught:
        render(_vllm(resources=resources, engine={"deterministic": True}))
    assert caught.value.reason == "DeterministicUnsupported"  # the Ready=False reason the handlers report
    assert "--deterministic" not in _engine(_vllm(resources=resources, engine={"deterministic": False}))["args"]
