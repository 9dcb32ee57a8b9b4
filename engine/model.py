"""Llama-family decoder over a paged KV cache.

RMSNorm, rotary position embeddings (rotate-half layout, theta from the config), grouped-query
attention, SwiGLU MLP, optionally tied embeddings. Shapes: N = tokens in the step (all sequences
packed), H = query heads, Hkv = key/value heads, D = head dim, C = hidden size.

The families (engine/loader/architectures.py) differ in three places, each off for plain Llama:
Llama 3.x scales the rotary frequencies (`rope_freq_factors`), Qwen2 adds a bias to q/k/v
(`qkv_bias`), Qwen3 RMS-normalizes each q and k head before RoPE (`qk_norm`). Mistral is Llama.

`forward` reads and writes the paged cache; `forward_dense` is the plain full-recompute reference the
tests compare it against.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from decodeservice.engine import elementwise
from decodeservice.engine.attention import StepAttention, attend
from decodeservice.engine.config import ModelConfig
from decodeservice.engine.loader.fused import FusedWeights, as_int4, dense, fuse_hf_weights
from decodeservice.engine.quant.embedding import Int4Embedding, Int8Embedding
from decodeservice.engine.quant.int4 import Int4Weight
from decodeservice.engine.quant.kernel_plan import KernelPlan
from decodeservice.engine.quant.linear import (
    Int4Linear,
    Int8Linear,
)
from decodeservice.engine.quant.step_rows import PLAIN_ROWS, StepRows, tiled_linear
from decodeservice.engine.quant.w8a8 import quantize_int8


@dataclass(frozen=True, kw_only=True)
class ForwardBatch:
    input_ids: torch.Tensor  # (N,)
    positions: torch.Tensor  # (N,)
    attn: StepAttention  # where each sequence's keys lie in the pool, and the backend that reads them
    logits_index: torch.Tensor  # (S,) packed rows whose logits are wanted
    rows: StepRows = PLAIN_ROWS  # which rows are prompt rows, for the projections (quant/step_rows.py)


# Attention of one layer over the step's cache: (layer index, q (N, H, D), k, v (N, Hkv, D)) -> (N, H, D).
# The eager forward binds it to the step's metadata; the compiled step (compiled_step.py) to an opaque op.
AttendLayer = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Linear(nn.Linear):
    """A bias-free projection that can swap its weight for oneDNN's pre-packed CPU layout.

    On CPU, fp32 `F.linear` goes through a GEMM that handles a handful of rows badly: a speculative
    verify's few rows cost far more than one decode row, although both stream the same weights from
    memory. oneDNN with a weight packed once at load time narrows that and runs a single row faster too
    (`benchmarks/spec_decode.py`'s `draft_row_cost` on fp32 weights)."""

    packed: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor, rows: StepRows = PLAIN_ROWS) -> torch.Tensor:  # typed; no hook dispatch
        return self.forward(x, rows)

    def forward(self, x: torch.Tensor, rows: StepRows = PLAIN_ROWS) -> torch.Tensor:
        return rows.run(x, prompt=self._tiled, other=self._plain, invariant=self._tiled, out_features=self.out_features)

    def _plain(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
            return out
        return F.linear(x, self.weight)

    def _tiled(self, x: torch.Tensor) -> torch.Tensor:
        """Prompt rows, and every row in deterministic mode: computed as in any call of whole ROW_TILEs
        (step_rows.StepRows)."""
        return tiled_linear(x, self._plain)

    def pack_for_cpu(self, *, keep_plain: bool) -> bool:
        """Pack the weight for oneDNN; False (and unchanged) where unsupported.

        Unless `keep_plain` (the weight is shared, as a tied embedding is), the plain copy is dropped,
        so packing costs no memory."""
        if self.packed is not None:
            return True
        weight = self.weight
        onednn = torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
        if weight.device.type != "cpu" or weight.dtype != torch.float32 or not onednn:
            return False
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
            probe = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0))
            got = torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
        except (RuntimeError, AttributeError):  # a torch build without these oneDNN ops
            return False
        if not torch.allclose(got, F.linear(probe, weight), rtol=1e-4, atol=1e-4):
            return False
        self.packed = packed
        if not keep_plain:
            self.weight = nn.Parameter(torch.empty(0), requires_grad=False)
        return True


# What a projection can be: dense (fp32 oneDNN-packed, bf16, fp16) or weight-only quantized.
Projection = Linear | Int8Linear | Int4Linear
Embedding = nn.Embedding | Int4Embedding | Int8Embedding



class RMSNorm(nn.Module):
    """Over the last dimension; `dim` may be a shape, e.g. (heads, D) for a weight per head (Qwen3)."""

    def __init__(self, dim: int | tuple[int, ...], eps: float, passes: ModuleType | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.passes = passes  # the native elementwise passes (elementwise.ElementwisePlan.kernel), or None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # typed, and no hook dispatch (61 calls a step)
        return self.forward(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return elementwise.rms_norm(x, self.weight, self.eps, self.passes)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + residual, this norm of it): a residual add and the norm after it, one pass."""
        return elementwise.add_rms_norm(x, residual, self.weight, self.eps, self.passes)


class Rotary(nn.Module):
    def __init__(self, head_dim: int, theta: float, max_positions: int,
                 freq_factors: tuple[float, ...] | None = None) -> None:
        super().__init__()
        self.head_dim, self.theta, self.max_positions = head_dim, theta, max_positions
        self.freq_factors = freq_factors  # (D/2,) divisors of the frequencies (Llama 3.x), or None
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.reset_tables()

    def reset_tables(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the cos/sin tables in fp32, e.g. after the module was built on the meta device."""
        d = self.head_dim
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))  # (D/2,)
        if self.freq_factors is not None:
            # Llama 3.x: long wavelengths slowed by `factor`, short ones kept, a smooth blend between.
            inv_freq = inv_freq / torch.tensor(self.freq_factors, dtype=torch.float32, device=device)
        angles = torch.outer(torch.arange(self.max_positions, dtype=torch.float32, device=device), inv_freq)
        self.cos = torch.cat([angles, angles], dim=-1).cos()  # (P, D)
        # rotate-half negates the first half of the swapped vector; the sign lives in the table, so no
        # layer spends a kernel on it.
        self.sin = torch.cat([-angles, angles], dim=-1).sin()

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin (N, 1, D) for these positions; looked up once per step, used by every layer."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, passes: ModuleType | None) -> torch.Tensor:
        # x: (N, heads, D); x * cos + [-x2, x1] * sin, with sin's first half already negated (one pass)
        return elementwise.rotate(x, cos, sin, passes)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, passes: ModuleType | None = None) -> None:
        super().__init__()
        self.passes = passes
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        # q, k and v in one matmul: the weights are streamed from memory once.
        self.qkv_proj: Projection = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj: Projection = Linear(self.q_size, cfg.hidden_size, bias=False)
        # Qwen2: q/k/v biases, one add after the (possibly quantized) projection; dense in the activation dtype.
        self.qkv_bias = nn.Parameter(torch.zeros(self.q_size + 2 * self.kv_size)) if cfg.qkv_bias else None
        # Qwen3: q_norm and k_norm, one weight row per head (q_norm's H times, then k_norm's Hkv times), so
        # q and k heads normalize in one call, as they rotate in one.
        self.qk_norm = (RMSNorm((cfg.num_heads + cfg.num_kv_heads, cfg.head_dim), cfg.rms_norm_eps, passes)
                        if cfg.qk_norm else None)

    def project(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], rows: StepRows = PLAIN_ROWS
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = x.shape[0]
        qkv = self.qkv_proj(x, rows)  # (N, (H + 2 Hkv) D)
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias
        qk, v = torch.split(qkv, [self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.reshape(n, self.num_heads + self.num_kv_heads, self.head_dim)  # (N, H + Hkv, D)
        if self.qk_norm is not None:
            qk = self.qk_norm(qk)
        # q and k heads rotate together: one set of elementwise ops per layer instead of two.
        qk = Rotary.rotate(qk, *rope, self.passes)
        q, k = torch.split(qk, [self.num_heads, self.num_kv_heads], dim=1)  # (N, H, D), (N, Hkv, D)
        return q, k, v.view(n, self.num_kv_heads, self.head_dim)

    def __call__(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], layer_index: int,
                 attend_layer: AttendLayer, rows: StepRows = PLAIN_ROWS) -> torch.Tensor:  # typed, no hook dispatch
        return self.forward(x, rope, layer_index, attend_layer, rows)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], layer_index: int,
                attend_layer: AttendLayer, rows: StepRows = PLAIN_ROWS) -> torch.Tensor:
        # x: (N, C)
        q, k, v = self.project(x, rope, rows)
        attended = attend_layer(layer_index, q, k, v)  # (N, H, D)
        return self.o_proj(attended.reshape(x.shape[0], self.q_size), rows)

    def forward_dense(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], rows: StepRows = PLAIN_ROWS
                      ) -> torch.Tensor:
        # x: (T, C), one sequence, no cache
        q, k, v = self.project(x, rope, rows)
        attended = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
            is_causal=True, enable_gqa=True,
        )  # (1, H, T, D)
        return self.o_proj(attended[0].transpose(0, 1).reshape(x.shape[0], self.q_size), rows)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, passes: ModuleType | None = None) -> None:
        super().__init__()
        self.passes = passes
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj: Projection = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj: Projection = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def __call__(self, x: torch.Tensor, rows: StepRows = PLAIN_ROWS) -> torch.Tensor:  # typed, no hook dispatch
        return self.forward(x, rows)

    def forward(self, x: torch.Tensor, rows: StepRows = PLAIN_ROWS) -> torch.Tensor:
        gate_up = self.gate_up_proj(x, rows)
        return self.down_proj(elementwise.silu_and_mul(gate_up, self.intermediate, self.passes), rows)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, passes: ModuleType | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, passes)
        self.self_attn = Attention(cfg, passes)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, passes)
        self.mlp = MLP(cfg, passes)


class LlamaModel(nn.Module):
    # Quantized on CPU: the kernel plan its projections were built with (engine/quant/kernel_plan.py), as
    # load_fused received it; None for dense weights or modules on their defaults.
    kernel_plan: KernelPlan | None = None

    def __init__(self, cfg: ModelConfig, elementwise_plan: elementwise.ElementwisePlan = elementwise.TORCH_OPS) -> None:
        super().__init__()
        self.config = cfg
        # Whether the layers' norms, activation and RoPE take the native passes: decided by the builder
        # (engine.build_model: elementwise.plan_elementwise) and handed to every module here.
        self.elementwise_plan = elementwise_plan
        passes = elementwise_plan.kernel
        embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens: Embedding = embed
        self.layers = nn.ModuleList(DecoderLayer(cfg, passes) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, passes)
        head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            head.weight = embed.weight
        self.lm_head: Projection = head
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings, cfg.rope_freq_factors)

    @property
    def activation_dtype(self) -> torch.dtype:
        """Activations and the KV cache run in the norms' dtype (bf16 when the weights are quantized)."""
        return self.norm.weight.dtype

    @property
    def weight_format(self) -> str:
        head = self.lm_head
        return "int4" if isinstance(head, Int4Linear) else "int8" if isinstance(head, Int8Linear) else "none"

    def tie_weights(self) -> None:
        """Point a plain tied head at the embedding again (after `to_empty`, which unties them)."""
        if self.config.tie_word_embeddings and isinstance(self.lm_head, Linear):
            assert isinstance(self.embed_tokens, nn.Embedding)
            self.lm_head.weight = self.embed_tokens.weight

    def decoder_layers(self) -> list[DecoderLayer]:
        return list(self.layers)  # type: ignore[arg-type]

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                *, num_layers: int | None = None) -> torch.Tensor:
        """Hidden states (S, C) of the rows in batch.logits_index, after the final norm.

        `num_layers` runs only the first L layers (self-drafting reuses the target this way)."""

        def attend_layer(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return attend(q, k, v, *kv_caches[i], batch.attn)

        return self.run_layers(batch.input_ids, batch.positions, batch.logits_index, attend_layer,
                               num_layers=self.layers_to_run(num_layers, kv_caches), rows=batch.rows)

    def layers_to_run(self, num_layers: int | None, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
        """The first L layers a forward runs: `num_layers` (all when None), no more than there are caches."""
        return min(num_layers or self.config.num_layers, len(kv_caches))

    def run_layers(self, input_ids: torch.Tensor, positions: torch.Tensor, logits_index: torch.Tensor,
                   attend_layer: AttendLayer, *, num_layers: int, rows: StepRows = PLAIN_ROWS) -> torch.Tensor:
        """The forward on plain tensors, attention behind `attend_layer`: what torch.compile traces.
        `rows`: the step's row split, for every projection (quant/step_rows.py)."""
        h = self.embed_tokens(input_ids)  # (N, C), the residual stream
        rope = self.rotary.tables(positions, h.dtype)
        layers = self.decoder_layers()[:num_layers]
        x = layers[0].input_layernorm(h) if layers else h  # each layer's input, normed
        # Each residual add goes with the norm after it (one pass); the last one's norm is the final norm's,
        # over the rows that sample only.
        for i, layer in enumerate(layers):
            h, x = layer.post_attention_layernorm.add_and_norm(h, layer.self_attn(x, rope, i, attend_layer, rows))
            delta = layer.mlp(x, rows)
            if i + 1 < len(layers):
                h, x = layers[i + 1].input_layernorm.add_and_norm(h, delta)
            else:
                h = h + delta
        hidden: torch.Tensor = self.norm(h[logits_index])  # (S, C)
        return hidden

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, rows: StepRows = PLAIN_ROWS) -> torch.Tensor:
        """`rows`: the head's (StepRows(deterministic=True) in deterministic mode; no prompt rows here)."""
        return self.lm_head(hidden, rows).float()  # (S, V)

    @torch.inference_mode()
    def forward_dense(self, input_ids: torch.Tensor, *, num_layers: int | None = None,
                      rows: StepRows = PLAIN_ROWS) -> torch.Tensor:
        """Reference path: logits (T, V) for one sequence (T,), recomputing everything; `rows` as a step's."""
        positions = torch.arange(input_ids.shape[0], device=input_ids.device)
        h = self.embed_tokens(input_ids)  # (T, C)
        rope = self.rotary.tables(positions, h.dtype)
        for layer in self.decoder_layers()[:num_layers]:
            h = h + layer.self_attn.forward_dense(layer.input_layernorm(h), rope, rows)
            h = h + layer.mlp(layer.post_attention_layernorm(h), rows)
        return self.compute_logits(self.norm(h), rows)

    def pack_weights_for_cpu(self) -> int:
        """Pre-pack every projection for oneDNN when the model runs fp32 on CPU; idempotent.

        Returns how many were packed. Call after the weights are loaded: packing copies them."""
        head, embed = self.lm_head, self.embed_tokens
        shared = isinstance(head, Linear) and isinstance(embed, nn.Embedding) and head.weight is embed.weight
        return sum(module.pack_for_cpu(keep_plain=module is self.lm_head and shared)
                   for module in self.modules() if isinstance(module, Linear))

    # -- weights -----------------------------------------------------------------------------------
    def load_hf_weights(self, weights: Mapping[str, torch.Tensor], *, int4: Mapping[str, Int4Weight] | None = None,
                        weight_format: str = "none", w8a8: bool = False, kernels: KernelPlan | None = None) -> None:
        """Load HF Llama-named tensors (fuse_hf_weights), see load_fused."""
        self.load_fused(fuse_hf_weights(self.config, weights, int4=int4), weight_format=weight_format, w8a8=w8a8,
                        kernels=kernels)

    def load_fused(self, fused: FusedWeights, *, weight_format: str = "none", w8a8: bool = False,
                   kernels: KernelPlan | None = None) -> None:
        """With `weight_format` int8 or int4 the projections, the head and the embedding become quantized
        modules (from the 4-bit codes directly where the format is int4), each built with its LinearPlan
        from `kernels` (planned from `fused.projection_shapes`; None: the modules' defaults, outside an
        engine); norms stay dense. `w8a8`: those modules may run many rows as int8 x int8
        (engine/quant/w8a8.py). The model keeps `kernels` as the record of what it was built with."""
        state = dict(fused.state)
        tied = self.config.tie_word_embeddings
        if weight_format == "none":
            state.update({f"{name}.weight": dense(w) for name, w in fused.projections.items()
                          if not (tied and name == "lm_head")})
            state["embed_tokens.weight"] = dense(fused.embedding)
        else:
            self._quantize(fused, weight_format, w8a8=w8a8, kernels=kernels)
            self.kernel_plan = kernels
        missing, unexpected = self.load_state_dict(state, strict=False)
        if set(missing) - {"lm_head.weight"} or unexpected:  # a tied head has no weight of its own
            raise ValueError(f"weight mismatch: missing={missing} unexpected={unexpected}")

    def _quantize(self, fused: FusedWeights, weight_format: str, *, w8a8: bool, kernels: KernelPlan | None) -> None:
        dtype, tied = self.activation_dtype, self.config.tie_word_embeddings
        shapes = dict(zip(fused.projections, fused.projection_shapes(weight_format=weight_format, w8a8=w8a8),
                          strict=True))
        plans = {name: kernels.linear(shape) if kernels is not None else None for name, shape in shapes.items()}
        if weight_format == "int4":
            int4s = {name: as_int4(weight) for name, weight in fused.projections.items()}
            for name, int4 in int4s.items():
                self.set_submodule(name, Int4Linear(int4, dtype=dtype, w8a8=w8a8, plan=plans[name]))
            # The embedding dequantizes looked-up rows from nibble codes (the kernel's layout is opaque);
            # tied, they are the head's own codes.
            self.embed_tokens = Int4Embedding(int4s["lm_head"] if tied else as_int4(fused.embedding), dtype=dtype)
            return
        for name, weight in fused.projections.items():
            self.set_submodule(name, Int8Linear(dense(weight), dtype=dtype, w8a8=w8a8, plan=plans[name]))
        head = self.lm_head
        if tied and isinstance(head, Int8Linear):
            self.embed_tokens = Int8Embedding(head.weight_int8, head.scales, dtype=dtype)
        else:
            codes, scales = quantize_int8(dense(fused.embedding))
            self.embed_tokens = Int8Embedding(codes, scales.to(dtype), dtype=dtype)
