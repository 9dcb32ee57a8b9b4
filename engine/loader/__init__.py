"""Getting a model from disk into memory.

    path = resolve_model_path("smollm2-135m")      # a known name (pulled if missing), a .gguf, or a HF dir
    model = load_model(path, dtype=torch.float32)  # config + HF-named weights + tokenizer

Both loaders hand back the same `LoadedModel`: weights named and shaped like HF's LlamaForCausalLM
state dict ([out_features, in_features], as nn.Linear stores them; Qwen2's q/k/v biases and Qwen3's
q/k norms as in Qwen2ForCausalLM / Qwen3ForCausalLM), so the model code has one layout. Which families
load: engine/loader/architectures.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from decodeservice.engine.config import ModelConfig
from decodeservice.engine.errors import UnknownModelError, UnsupportedModelError
from decodeservice.engine.loader.registry import (
    DEFAULT_MODEL,
    KNOWN_MODELS,
    KnownModel,
    cached_path,
    ensure_model,
    known_model,
    model_cache_dir,
    pull,
    resolve_model_path,
)
from decodeservice.engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    import torch

    from decodeservice.engine.quant.int4 import Int4Weight

__all__ = [
    "DEFAULT_MODEL",
    "KNOWN_MODELS",
    "KnownModel",
    "LoadedModel",
    "cached_path",
    "check_weights",
    "ensure_model",
    "expected_weight_shapes",
    "known_model",
    "load_model",
    "model_cache_dir",
    "pull",
    "resolve_model_path",
]


@dataclass(frozen=True, kw_only=True)
class LoadedModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor]  # HF names (LlamaForCausalLM's, + Qwen's biases and q/k norms), contiguous
    tokenizer: Tokenizer
    # With native_int4: the GGUF's Q4_0/Q4_1 tensors, kept 4-bit (and then not in `weights`).
    int4: dict[str, Int4Weight] = field(default_factory=dict)


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight a model of this config has, by HF name, with its [out, in] shape (or (out,) for
    biases and norms)."""
    hidden, q_dim, kv_dim = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, hidden)}
    for i in range(config.num_layers):
        prefix = f"model.layers.{i}"
        shapes[f"{prefix}.input_layernorm.weight"] = (hidden,)
        shapes[f"{prefix}.self_attn.q_proj.weight"] = (q_dim, hidden)
        shapes[f"{prefix}.self_attn.k_proj.weight"] = (kv_dim, hidden)
        shapes[f"{prefix}.self_attn.v_proj.weight"] = (kv_dim, hidden)
        shapes[f"{prefix}.self_attn.o_proj.weight"] = (hidden, q_dim)
        if config.qkv_bias:
            shapes.update({f"{prefix}.self_attn.q_proj.bias": (q_dim,), f"{prefix}.self_attn.k_proj.bias": (kv_dim,),
                           f"{prefix}.self_attn.v_proj.bias": (kv_dim,)})
        if config.qk_norm:
            shapes.update({f"{prefix}.self_attn.q_norm.weight": (config.head_dim,),
                           f"{prefix}.self_attn.k_norm.weight": (config.head_dim,)})
        shapes[f"{prefix}.post_attention_layernorm.weight"] = (hidden,)
        shapes[f"{prefix}.mlp.gate_proj.weight"] = (config.intermediate_size, hidden)
        shapes[f"{prefix}.mlp.up_proj.weight"] = (config.intermediate_size, hidden)
        shapes[f"{prefix}.mlp.down_proj.weight"] = (hidden, config.intermediate_size)
    shapes["model.norm.weight"] = (hidden,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    return shapes


def check_weights(weights: Mapping[str, torch.Tensor | Int4Weight], config: ModelConfig, *, source: Path) -> None:
    """Reject a file whose tensors do not make up exactly the model its config describes."""
    expected = expected_weight_shapes(config)
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise UnsupportedModelError(f"{source}: missing {len(missing)} weight(s), e.g. {', '.join(missing[:3])}")
    unexpected = sorted(set(weights) - set(expected))
    if unexpected:
        raise UnsupportedModelError(
            f"{source}: unexpected weight(s) {', '.join(unexpected[:3])} (not the architecture its config names?)"
        )
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise UnsupportedModelError(
                f"{source}: {name} has shape {tuple(weights[name].shape)}, the config implies {shape}"
            )


def load_model(path: Path, *, dtype: torch.dtype | None = None, native_int4: bool = False) -> LoadedModel:
    """Load a GGUF file or a HF model directory (config.json + *.safetensors + tokenizer.json).

    dtype defaults to float32. With `native_int4`, a GGUF's Q4_0/Q4_1 tensors come back 4-bit in
    `LoadedModel.int4`, never dequantized. Raises UnknownModelError when nothing is at `path`, and
    UnsupportedModelError for a corrupt file or an architecture/tensor type we cannot run.
    """
    import torch

    dtype = torch.float32 if dtype is None else dtype
    path = Path(path)
    if path.is_dir():
        from decodeservice.engine.loader.hf_loader import load_hf_dir

        return load_hf_dir(path, dtype=dtype)
    if path.is_file():
        from decodeservice.engine.loader.gguf_loader import load_gguf

        return load_gguf(path, dtype=dtype, native_int4=native_int4)
    raise UnknownModelError(f"no model file or directory at {path}")
