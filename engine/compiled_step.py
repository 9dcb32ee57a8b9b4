"""The single-row decode step with its non-attention work compiled by torch.compile (inductor, CPU).

Between two attentions a layer runs o_proj, a residual add, a norm, the MLP, another residual add, and
then the next layer's norm, QKV projection and rope: a dozen small elementwise kernels around four
matmuls, each paying Python and dispatch per call at one row. Compiled as one graph per layer boundary
(attention stays eager: it reads the step's Python metadata), those fuse into a few kernels around the
same weight-only matmuls. Measured (benchmarks/decode_compile.py, int4, 1 thread): the forward of one
row 12.35 vs 13.61 ms eager (min of 15), ~2 s to compile; no gain at 32 rows (141.7 vs 138.9 ms, within
noise), and the same layout compiled for a symbolic batch was slower there. So only steps of exactly one
row take it (one stream decoding; dynamo specializes size 1 anyway), and everything else runs eager.

Numerics: the fused kernels round bf16 intermediates differently from eager (final hidden states
differ by up to ~0.2 in bf16 on the bundled model, the greedy tokens did not change), so a compiled
engine is deterministic but not bit-identical to an eager one.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from decodeservice.engine.attention import attend
from decodeservice.engine.errors import ConfigError
from decodeservice.engine.model import DecoderLayer, ForwardBatch, Linear, LlamaModel

Rope = tuple[torch.Tensor, torch.Tensor]


def _enter(layer: DecoderLayer, h: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return layer.self_attn.project(layer.input_layernorm(h), rope)


def _leave(layer: DecoderLayer, h: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
    # attended: (N, H, D) -> the layer's output (N, C)
    h = h + layer.self_attn.o_proj(attended.reshape(h.shape[0], layer.self_attn.q_size))
    return h + layer.mlp(layer.post_attention_layernorm(h))


def _boundary(layer: DecoderLayer, after: DecoderLayer, h: torch.Tensor, attended: torch.Tensor, rope: Rope
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    h = _leave(layer, h, attended)
    return (h, *_enter(after, h, rope))


class CompiledDecodeStep:
    """`model.forward` for a one-row batch, with the layer boundaries compiled. Same contract."""

    def __init__(self, model: LlamaModel) -> None:
        if any(isinstance(m, Linear) and m.packed is not None for m in model.modules()):
            # Inductor's lowering of mkldnn._linear_pointwise asserts on weights it did not pack itself.
            raise ConfigError("compile needs quantized weights (int4 or int8), or fp32 without oneDNN "
                              "packing (pack_cpu_weights=False): inductor cannot compile the packed ones")
        self.model = model
        # dynamic=False: one graph per piece for N = 1. The layers share each graph (their modules are
        # graph inputs), so 30 layers still compile three graphs.
        with warnings.catch_warnings():
            # torch 2.13's inductor imports torch.utils.mkldnn, which uses its own deprecated
            # torch.jit.script_method at import time: nothing this engine calls.
            warnings.filterwarnings("ignore", message=r"`torch\.jit\.script_method` is deprecated",
                                    category=DeprecationWarning)
            import torch._inductor.compile_fx
        compile_fn: Callable[[Any], Any] = torch.compile(dynamic=False)
        self._enter, self._boundary, self._leave = compile_fn(_enter), compile_fn(_boundary), compile_fn(_leave)

    @staticmethod
    def applies_to(batch: ForwardBatch) -> bool:
        return batch.input_ids.shape[0] == 1

    @torch.inference_mode()
    def __call__(self, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 *, num_layers: int | None = None) -> torch.Tensor:
        model = self.model
        layers = model.decoder_layers()[:num_layers][: len(kv_caches)]
        h = model.embed_tokens(batch.input_ids)  # (1, C)
        rope = model.rotary.tables(batch.positions, h.dtype)
        q, k, v = self._enter(layers[0], h, rope)
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(layers, kv_caches, strict=False)):  # layers <= caches
            attended = attend(q, k, v, k_cache, v_cache, batch.attn)  # (1, H, D)
            if i + 1 < len(layers):
                h, q, k, v = self._boundary(layer, layers[i + 1], h, attended, rope)
            else:
                h = self._leave(layer, h, attended)
        hidden: torch.Tensor = model.norm(h[batch.logits_index])  # (S, C)
        return hidden
