"""Load a HF Llama model directory: config.json, *.safetensors, tokenizer.json (+ its config files)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from decodeservice.engine.config import ModelConfig
from decodeservice.engine.errors import ConfigError, UnsupportedModelError
from decodeservice.engine.loader import LoadedModel, check_weights
from decodeservice.engine.tokenizer import Tokenizer

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)


def load_hf_dir(path: Path, *, dtype: torch.dtype) -> LoadedModel:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    raw = _read_config(path / "config.json")
    tokenizer = Tokenizer.from_hf_dir(path)
    config = _config(raw, tokenizer, path=path)

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UnsupportedModelError(f"{path} has no *.safetensors weights (.bin checkpoints are not supported)")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors = load_file(file)
        except (SafetensorError, OSError, ValueError) as exc:
            raise UnsupportedModelError(f"{file} is not a readable safetensors file: {exc}") from exc
        for name, tensor in tensors.items():
            if name == "lm_head.weight" and config.tie_word_embeddings:
                continue  # some exports save the tied head too; it is the embedding
            if name.endswith("rotary_emb.inv_freq"):
                continue  # a buffer old exports saved; the model recomputes it
            weights[name] = tensor.to(dtype).contiguous()
    check_weights(weights, config, source=path)
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer)


def _read_config(file: Path) -> dict[str, Any]:
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UnsupportedModelError(f"cannot read {file}: {exc}") from exc
    if not isinstance(raw, dict):
        raise UnsupportedModelError(f"{file} is not a JSON object")
    return raw


def _config(raw: dict[str, Any], tokenizer: Tokenizer, *, path: Path) -> ModelConfig:
    architectures = raw.get("architectures") or []
    if raw.get("model_type") != "llama" or not set(architectures) <= set(SUPPORTED_ARCHITECTURES):
        raise UnsupportedModelError(
            f"{path}: model_type {raw.get('model_type')!r} / architectures {architectures} is not supported; "
            f"only llama ({', '.join(SUPPORTED_ARCHITECTURES)}) is"
        )
    if raw.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"{path}: hidden_act {raw['hidden_act']!r} is not supported; only silu")
    for flag in ("attention_bias", "mlp_bias"):
        if raw.get(flag):
            raise UnsupportedModelError(f"{path}: {flag}=true is not supported")
    # transformers 5 writes rope settings under rope_parameters; older configs use rope_theta/rope_scaling.
    rope = raw.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", "default")
    if raw.get("rope_scaling") or rope_type != "default":
        raise UnsupportedModelError(f"{path}: RoPE scaling is not supported")
    try:
        hidden = int(raw["hidden_size"])
        num_heads = int(raw["num_attention_heads"])
        return ModelConfig(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            # LlamaConfig's own default is untied.
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=tokenizer.bos_token_id if tokenizer.bos_token_id is not None else _bos(raw),
            eos_token_ids=tuple(dict.fromkeys(tokenizer.eos_token_ids + _ids(raw.get("eos_token_id")))),
        )
    except KeyError as exc:
        raise UnsupportedModelError(f"{path}/config.json has no {exc.args[0]!r}") from exc
    except (ConfigError, TypeError, ValueError, ZeroDivisionError) as exc:
        raise UnsupportedModelError(f"{path}/config.json is inconsistent: {exc}") from exc


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list) else (int(value),)


def _bos(raw: dict[str, Any]) -> int | None:
    value = raw.get("bos_token_id")
    return int(value) if value is not None else None
