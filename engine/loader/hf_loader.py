"""Load a HF model directory: config.json, *.safetensors, tokenizer.json (+ its config files).

Llama (2, 3.x), Mistral, Qwen2/2.5 and Qwen3, as engine/loader/architectures.py lists them."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from decodeservice.engine.config import ModelConfig
from decodeservice.engine.errors import ConfigError, UnsupportedModelError
from decodeservice.engine.loader import LoadedModel, check_weights
from decodeservice.engine.loader.architectures import check_hf_config, rope_parameters
from decodeservice.engine.tokenizer import Tokenizer


def read_hf_config(path: Path) -> tuple[ModelConfig, Tokenizer]:
    """The architecture and tokenizer of a HF model directory, without reading its weights."""
    raw = _read_config(path / "config.json")
    tokenizer = Tokenizer.from_hf_dir(path)
    return _config(raw, tokenizer, path=path), tokenizer


def load_hf_dir(path: Path, *, dtype: torch.dtype) -> LoadedModel:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config, tokenizer = read_hf_config(path)

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
    family = check_hf_config(raw, source=str(path / "config.json"))
    rope = rope_parameters(raw)
    try:
        theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
        hidden = int(raw["hidden_size"])
        num_heads = int(raw["num_attention_heads"])
        head_dim = int(raw.get("head_dim") or family.default_head_dim or hidden // num_heads)
        max_positions = int(raw.get("max_position_embeddings", 2048))
        window = _sliding_window(raw, family.model_type)
        return ModelConfig(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            # Attention here is full: a sliding-window model is exact while its context fits in the window.
            max_position_embeddings=max_positions if window is None else min(max_positions, window),
            # The four families' configs all default to untied.
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=tokenizer.bos_token_id if tokenizer.bos_token_id is not None else _bos(raw),
            eos_token_ids=tuple(dict.fromkeys(tokenizer.eos_token_ids + _ids(raw.get("eos_token_id")))),
            qkv_bias=family.qkv_bias,
            qk_norm=family.qk_norm,
            rope_freq_factors=_llama3_freq_factors(rope, theta=theta, head_dim=head_dim) if rope["rope_type"] == "llama3" else None,
            sliding_window=window,
        )
    except KeyError as exc:
        raise UnsupportedModelError(f"{path}/config.json has no {exc.args[0]!r}") from exc
    except (ConfigError, TypeError, ValueError, ZeroDivisionError) as exc:
        raise UnsupportedModelError(f"{path}/config.json is inconsistent: {exc}") from exc


def _sliding_window(raw: dict[str, Any], model_type: str) -> int | None:
    """The attention window some layers use, or None when every layer attends to the whole context.

    Mistral's `sliding_window` applies to every layer (null in v0.2+); Qwen2/Qwen3 configs carry one that
    counts only with `use_sliding_window` (transformers 5 also writes the per-layer `layer_types`)."""
    window = raw.get("sliding_window")
    if window is None or model_type not in ("mistral", "qwen2", "qwen3"):
        return None
    windowed = (model_type == "mistral" or bool(raw.get("use_sliding_window"))
                or "sliding_attention" in (raw.get("layer_types") or []))
    return int(window) if windowed else None


def _llama3_freq_factors(rope: dict[str, Any], *, theta: float, head_dim: int) -> tuple[float, ...]:
    """rope_type llama3 (Llama 3.1-3.3) as the divisor of each rotary frequency, computed as llama.cpp's
    converter writes rope_freqs.weight: wavelengths under original/high_freq_factor keep their frequency,
    those over original/low_freq_factor are slowed by `factor`, and those between blend smoothly. The
    same frequencies as transformers' _compute_llama3_parameters."""
    factor = float(rope["factor"])
    low, high = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    original = float(rope["original_max_position_embeddings"])
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < original / high:
            factors.append(1.0)
        elif wavelen > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            factors.append(1.0 / ((1 - smooth) / factor + smooth))
    return tuple(factors)


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list) else (int(value),)


def _bos(raw: dict[str, Any]) -> int | None:
    value = raw.get("bos_token_id")
    return int(value) if value is not None else None
