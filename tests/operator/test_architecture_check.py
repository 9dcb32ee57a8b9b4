"""A model the builtin engine cannot run is refused before its weights are downloaded.

At reconcile when the spec names the architecture (spec.model.architecture), else by the init container,
which checks each hf:// config.json (the model's and the draft's) before any snapshot download."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from decodeservice.engine.loader.architectures import SUPPORTED_GGUF_ARCHITECTURES, SUPPORTED_MODEL_TYPES
from decodeservice.operator.engines import HF_CONFIG_CHECK, HF_DOWNLOAD
from decodeservice.operator.errors import InvalidSpecError
from decodeservice.operator.manifests import Children, render
from decodeservice.operator.spec import validate_spec
from tests.operator.conftest import Cluster
from tests.operator.schema import validate
from tests.support.kube_emulator import DEPLOYMENTS, DS

DS_PATH = "/apis/decode.dev/v1alpha1/namespaces/default/decodeservices"
GEMMA = {"uri": "hf://google/gemma-2-2b-it", "architecture": "gemma2"}


def service(*, name: str = "m", kind: str = "builtin", model: dict[str, Any] | None = None,
            speculative: dict[str, Any] | None = None) -> dict[str, Any]:
    engine: dict[str, Any] = {"kind": kind, "quantization": "none" if kind == "builtin" else "auto"}
    if speculative is not None:
        engine["speculative"] = speculative
    return {"apiVersion": "decode.dev/v1alpha1", "kind": "DecodeService", "metadata": {"name": name},
            "spec": {"model": model or dict(GEMMA), "engine": engine, "resources": {"gpus": 1}}}


def init_commands(children: Children) -> list[list[str]]:
    spec = children.deployment["spec"]["template"]["spec"]
    (fetch,) = [c for c in spec.get("initContainers", []) if c["name"] == "fetch-model"]
    commands: list[list[str]] = json.loads(fetch["command"][-1])
    return commands


def test_an_unsupported_builtin_architecture_is_refused_with_the_supported_list() -> None:
    body = service()
    assert validate(body) == []  # the CRD takes any name: the list is the engine's, checked at reconcile
    with pytest.raises(InvalidSpecError) as caught:
        validate_spec(body["spec"])
    message = str(caught.value)
    assert message.startswith("spec.model.architecture: 'gemma2' is not supported by the builtin engine")
    assert all(t in message for t in (*SUPPORTED_MODEL_TYPES, *SUPPORTED_GGUF_ARCHITECTURES))
    assert "engine.kind: vllm" in message


def test_vllm_serves_the_same_model_and_supported_hints_pass() -> None:
    containers = render(service(kind="vllm")).deployment["spec"]["template"]["spec"]["containers"]
    engine = next(c for c in containers if c["name"] == "engine")
    assert "vllm.entrypoints.launchers.api_server.entry" in engine["command"] and engine["args"][1].endswith("google--gemma-2-2b-it@main")
    for model_type in SUPPORTED_MODEL_TYPES:
        validate_spec(service(model={"uri": "hf://org/m", "architecture": model_type})["spec"])
    with pytest.raises(InvalidSpecError, match="not supported by the builtin engine"):
        validate_spec(service(model={"uri": "bundled://smollm2-135m", "architecture": "phi3"})["spec"])


async def test_an_unsupported_architecture_is_ready_false_and_vllm_is_not(operator: Cluster) -> None:
    await operator.create(service(name="gemma"))

    def ready() -> dict[str, Any]:
        conditions = ((operator.get(DS, "gemma") or {}).get("status") or {}).get("conditions") or []
        return next((dict(c) for c in conditions if c["type"] == "Ready"), {})

    condition = await operator.wait_for(ready, what="Ready condition")
    assert (condition["status"], condition["reason"]) == ("False", "InvalidSpec")
    assert "'gemma2' is not supported by the builtin engine" in condition["message"]
    assert "engine.kind: vllm" in condition["message"]
    assert operator.get(DEPLOYMENTS, "gemma") is None  # no pod, so no download

    await operator.patch(f"{DS_PATH}/gemma", {"spec": {"engine": {"kind": "vllm", "quantization": "auto"}}})
    deployment = await operator.wait_for(lambda: operator.get(DEPLOYMENTS, "gemma"), what="vLLM Deployment")
    engine = next(c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "engine")
    assert "vllm.entrypoints.launchers.api_server.entry" in engine["command"]
    await operator.wait_for(lambda: ready().get("reason") != "InvalidSpec", what="InvalidSpec cleared")


DRAFT = {"method": "draft", "draftModel": "hf://org/draft@v1"}


def test_the_builtin_init_container_checks_every_config_before_any_weights() -> None:
    commands = init_commands(render(service(model={"uri": "hf://org/target"}, speculative=DRAFT)))
    scripts = [c[2] for c in commands]
    assert scripts == [HF_CONFIG_CHECK, HF_CONFIG_CHECK, HF_DOWNLOAD, HF_DOWNLOAD]
    assert [c[3:5] for c in commands] == [["org/target", "main"], ["org/draft", "v1"]] * 2
    assert "snapshot_download" not in HF_CONFIG_CHECK and "check_hf_config" in HF_CONFIG_CHECK
    # vLLM runs architectures the builtin engine does not: its pods download without the check.
    vllm = init_commands(render(service(kind="vllm", model={"uri": "hf://org/target"})))
    assert [c[2] for c in vllm] == [HF_DOWNLOAD]


def _check(command: list[str], target: Path) -> subprocess.CompletedProcess[str]:
    # The rendered check, pointed at `target`; offline, so any download attempt would fail loudly.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(target.parent / "hf-home")}
    argv = [sys.executable, *command[1:3], *command[3:5], str(target)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.parametrize(("config", "refusal"), [
    ({"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"]}, "model_type 'gemma2' is not supported"),
    ({"model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "RoPE scaling 'yarn'"),
    ({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}, None),
])
def test_the_check_refuses_an_unsupported_config_without_downloading(tmp_path: Path, config: dict[str, Any],
                                                                     refusal: str | None) -> None:
    commands = init_commands(render(service(model={"uri": "hf://org/target"}, speculative=DRAFT)))
    target = tmp_path / "org--target@main"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(config))
    done = _check(commands[0], target)
    assert sorted(p.name for p in target.iterdir()) == ["config.json"]  # nothing downloaded, nothing marked
    if refusal is None:
        assert done.returncode == 0, done.stderr
        return
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith("hf://org/target@main config.json: ") and refusal in done.stderr
    assert "serve other models with engine.kind: vllm" in done.stderr and "Traceback" not in done.stderr
