"""The model families the builtin engine runs, in one place.

    family = check_hf_config(json.loads(config_json))   # UnsupportedModelError, before any weight is read

HF directories are recognized by config.json's `model_type`, GGUF files by `general.architecture`
(llama.cpp converts Mistral as `llama`). Pure Python, no torch: the operator and the pods' init
container can import it to refuse a model before its weights are downloaded.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from decodeservice.engine.errors import UnsupportedModelError


@dataclass(frozen=True, kw_only=True)
class Family:
    """What sets a family apart from plain Llama, as far as the model code cares."""

    model_type: str  # config.json's model_type
    architecture: str  # config.json's architectures[0]
    qkv_bias: bool = False  # Qwen2: q, k and v projections carry a bias
    qk_norm: bool = False  # Qwen3: RMSNorm over each q and k head before RoPE
    default_head_dim: int | None = None  # when config.json omits head_dim; None: hidden_size // heads


FAMILIES: Final[Mapping[str, Family]] = {
    f.model_type: f
    for f in (
        Family(model_type="llama", architecture="LlamaForCausalLM"),  # Llama 2, 3, 3.1, 3.2, SmolLM
        Family(model_type="mistral", architecture="MistralForCausalLM"),
        Family(model_type="qwen2", architecture="Qwen2ForCausalLM", qkv_bias=True),  # Qwen2, Qwen2.5
        Family(model_type="qwen3", architecture="Qwen3ForCausalLM", qk_norm=True, default_head_dim=128),
    )
}
SUPPORTED_MODEL_TYPES: Final[tuple[str, ...]] = tuple(FAMILIES)
# GGUF `general.architecture` -> the family its tensors follow.
GGUF_FAMILIES: Final[Mapping[str, Family]] = {"llama": FAMILIES["llama"], "qwen2": FAMILIES["qwen2"],
                                              "qwen3": FAMILIES["qwen3"]}
SUPPORTED_GGUF_ARCHITECTURES: Final[tuple[str, ...]] = tuple(GGUF_FAMILIES)
# RoPE variants (config.json rope_type): plain, and Llama 3.1's frequency-dependent scaling.
SUPPORTED_ROPE_TYPES: Final[tuple[str, ...]] = ("default", "llama3")


def unsupported_model_message(what: str) -> str:
    """`what` is refused, with what is supported and where to go instead."""
    return (f"{what} is not supported by the builtin engine, which runs HF model_type "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} and GGUF architectures {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}; "
            "serve other models with engine.kind: vllm")


def rope_parameters(raw: Mapping[str, Any]) -> dict[str, Any]:
    """config.json's RoPE settings: transformers 5 writes `rope_parameters`, older configs `rope_scaling`
    (null when plain) beside `rope_theta`. The type is under `rope_type`, or `type` in old configs."""
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(rope, Mapping):
        raise UnsupportedModelError(f"config.json rope settings {rope!r} are not an object")
    params = dict(rope)
    params["rope_type"] = str(params.get("rope_type") or params.get("type") or "default")
    return params


def check_hf_config(raw: Mapping[str, Any], *, source: str = "config.json") -> Family:
    """The family of a HF config.json, or UnsupportedModelError naming what the engine cannot run.

    Checks only config.json (no weights, no tokenizer): what a pod can fetch first, before the weights."""
    model_type = raw.get("model_type")
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise UnsupportedModelError(f"{source}: " + unsupported_model_message(f"model_type {model_type!r}"))
    architectures = raw.get("architectures") or [family.architecture]
    if not isinstance(architectures, list) or set(architectures) != {family.architecture}:
        raise UnsupportedModelError(f"{source}: " + unsupported_model_message(
            f"architectures {architectures!r} (model_type {model_type!r} runs as {family.architecture})"))
    if raw.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"{source}: " + unsupported_model_message(f"hidden_act {raw['hidden_act']!r}"))
    # Llama's attention_bias also puts a bias on o_proj; Qwen2's q/k/v biases are not a flag.
    for flag in ("attention_bias", "mlp_bias"):
        if raw.get(flag):
            raise UnsupportedModelError(f"{source}: " + unsupported_model_message(f"{model_type} with {flag}=true"))
    rope_type = rope_parameters(raw)["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(f"{source}: " + unsupported_model_message(
            f"RoPE scaling {rope_type!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"))
    return family


def gguf_family(architecture: Any, *, source: str) -> Family:
    """The family of a GGUF's `general.architecture`, or UnsupportedModelError."""
    family = GGUF_FAMILIES.get(architecture) if isinstance(architecture, str) else None
    if family is None:
        raise UnsupportedModelError(f"{source}: " + unsupported_model_message(f"GGUF architecture {architecture!r}"))
    return family
