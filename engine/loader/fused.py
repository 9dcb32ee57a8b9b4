"""A checkpoint's tensors by LlamaModel's names, q/k/v and gate/up fused as it lays them out: the loaders
hand HF-named tensors (GGUF's renamed), LlamaModel.load_fused builds its modules from these. Fusing comes
first so that the quantized projections' shapes are known before any is built: the kernel plan
(engine/quant/kernel_plan.py) is made from them and each module receives its part at construction."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from decodeservice.engine.config import ModelConfig
from decodeservice.engine.quant.int4 import Int4Weight, quantize_int4
from decodeservice.engine.quant.kernel_plan import ProjectionShape


@dataclass(frozen=True, kw_only=True)
class FusedWeights:
    """A checkpoint's tensors by this model's names: q/k/v and gate/up fused as LlamaModel lays them out."""

    state: dict[str, torch.Tensor]  # dense whatever the weight format: norms (and Qwen's biases)
    projections: dict[str, torch.Tensor | Int4Weight]  # by module name, the head last
    embedding: torch.Tensor | Int4Weight

    def projection_shapes(self, *, weight_format: str, w8a8: bool) -> list[ProjectionShape]:
        """Each quantized module `load_fused` will build, in `projections`' order: what the kernel plan needs
        before any is built."""
        int4 = weight_format == "int4"
        return [ProjectionShape(int4=int4, out_features=w.shape[0], in_features=w.shape[1], w8a8=w8a8,
                                group_size=(w.group_size if isinstance(w, Int4Weight) else INT4_GROUP) if int4 else 0,
                                head=name == "lm_head")
                for name, w in self.projections.items()]


def fuse_hf_weights(cfg: ModelConfig, weights: Mapping[str, torch.Tensor], *,
                    int4: Mapping[str, Int4Weight] | None = None) -> FusedWeights:
    """HF Llama-named tensors (plus Qwen2's `q_proj.bias` etc. and Qwen3's `q_norm.weight` and
    `k_norm.weight`) by this model's names. `int4` holds weights that arrive as 4-bit (GGUF Q4_0/Q4_1), by
    the same names."""
    source: dict[str, torch.Tensor | Int4Weight] = {**weights, **(int4 or {})}
    fused: dict[str, torch.Tensor | Int4Weight] = {}
    # Norms (and Qwen's biases) stay dense whatever the weight format.
    state = {name.removeprefix("model."): dense(w) for name, w in source.items()
             if name.endswith("layernorm.weight") or name == "model.norm.weight"}
    for i in range(cfg.num_layers):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        fused[q + "self_attn.qkv_proj"] = cat([source[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
        fused[q + "self_attn.o_proj"] = source[p + "self_attn.o_proj.weight"]
        fused[q + "mlp.gate_up_proj"] = cat([source[p + "mlp.gate_proj.weight"], source[p + "mlp.up_proj.weight"]])
        fused[q + "mlp.down_proj"] = source[p + "mlp.down_proj.weight"]
        if cfg.qkv_bias:  # (H D + 2 Hkv D,), laid out as the fused projection's rows
            state[q + "self_attn.qkv_bias"] = torch.cat([dense(source[p + f"self_attn.{n}_proj.bias"]) for n in "qkv"])
        if cfg.qk_norm:  # (H + Hkv, D): q_norm's (D,) weight for every q head, then k_norm's for every k head
            q_norm, k_norm = (dense(source[p + f"self_attn.{n}_norm.weight"]) for n in "qk")
            state[q + "self_attn.qk_norm.weight"] = torch.cat(
                [q_norm.expand(cfg.num_heads, -1), k_norm.expand(cfg.num_kv_heads, -1)])
    embedding = source["model.embed_tokens.weight"]
    fused["lm_head"] = embedding if cfg.tie_word_embeddings else source["lm_head.weight"]
    return FusedWeights(state=state, projections=fused, embedding=embedding)


def dense(weight: torch.Tensor | Int4Weight) -> torch.Tensor:
    return weight.dequantize() if isinstance(weight, Int4Weight) else weight


# Weights quantized here take the GGUF block size: the kernel is as fast at 32 as at 64 here.
INT4_GROUP = 32


def as_int4(weight: torch.Tensor | Int4Weight) -> Int4Weight:
    """4-bit as it came, or quantized now in groups of INT4_GROUP."""
    return weight if isinstance(weight, Int4Weight) else quantize_int4(weight, group_size=INT4_GROUP)


def cat(parts: list[torch.Tensor | Int4Weight]) -> torch.Tensor | Int4Weight:
    if all(isinstance(p, Int4Weight) for p in parts):
        return Int4Weight.cat([p for p in parts if isinstance(p, Int4Weight)])
    return torch.cat([dense(p) for p in parts], dim=0)
