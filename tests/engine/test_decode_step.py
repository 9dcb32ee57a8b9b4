"""The decode step's building blocks against textbook formulas written out here, on tiny random models.

The model's norm is one fused kernel and its rotary table carries the rotate-half sign; the paged
forward is already compared with the model's own dense forward (test_paged_attention.py), so this
file checks that dense forward against an independent Llama written from the formulas."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from decodeservice.engine import elementwise
from decodeservice.engine.model import LlamaModel, RMSNorm, Rotary
from tests.conftest import ModelBundle, make_tiny_model


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (weight.float() * xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def reference_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    # x: (T, heads, D), rotate-half layout: pairs (i, i + D/2) rotate by position * theta^(-2i/D)
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = positions.double()[:, None] * inv_freq[None, :]  # (T, D/2)
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x.double()[..., : d // 2], x.double()[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def reference_logits(model: LlamaModel, ids: torch.Tensor) -> torch.Tensor:
    """fp64 Llama from the model's fp32 weights (unfused names, plain matmuls, plain softmax)."""
    cfg = model.config
    w = {k: v.double() for k, v in model.state_dict().items()}
    q_size, kv_size, d = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.head_dim
    t = ids.shape[0]
    positions = torch.arange(t)
    h = w["embed_tokens.weight"][ids]
    mask = torch.full((t, t), float("-inf"), dtype=torch.float64).triu(1)
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        x = reference_rms_norm(h, w[p + "input_layernorm.weight"], cfg.rms_norm_eps)
        q, k, v = (x @ w[p + "self_attn.qkv_proj.weight"].t()).split([q_size, kv_size, kv_size], dim=-1)
        q = reference_rope(q.view(t, cfg.num_heads, d), positions, cfg.rope_theta)
        k = reference_rope(k.view(t, cfg.num_kv_heads, d), positions, cfg.rope_theta)
        group = cfg.num_heads // cfg.num_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.view(t, cfg.num_kv_heads, d).repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / d**0.5 + mask
        attended = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(t, q_size)
        h = h + attended @ w[p + "self_attn.o_proj.weight"].t()
        x = reference_rms_norm(h, w[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
        gate, up = (x @ w[p + "mlp.gate_up_proj.weight"].t()).split(cfg.intermediate_size, dim=-1)
        h = h + (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].t()
    return reference_rms_norm(h, w["norm.weight"], cfg.rms_norm_eps) @ w["lm_head.weight"].t()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_the_formula(dtype: torch.dtype) -> None:
    for passes in (None, elementwise.elementwise_extension()):  # the torch ops, the native pass where built
        torch.manual_seed(0)
        norm = RMSNorm(48, 1e-5, passes)
        with torch.no_grad():
            norm.weight.copy_(torch.rand(48) + 0.5)
        norm = norm.to(dtype)
        x = (torch.randn(5, 48) * 3).to(dtype)
        tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: one rounding in the kernel, two in the formula
        torch.testing.assert_close(norm(x), reference_rms_norm(x, norm.weight, 1e-5), rtol=tol, atol=tol)


def test_rotary_matches_the_formula() -> None:
    torch.manual_seed(0)
    rotary = Rotary(16, 10000.0, 64)
    positions = torch.tensor([0, 1, 7, 63])
    x = torch.randn(4, 3, 16)
    for passes in (None, elementwise.elementwise_extension()):  # the torch ops, the native pass where built
        got = Rotary.rotate(x, *rotary.tables(positions, torch.float32), passes)
        torch.testing.assert_close(got.double(), reference_rope(x, positions, 10000.0), rtol=1e-5, atol=1e-5)


def test_tiny_model_matches_an_independent_llama(tiny: ModelBundle) -> None:
    model = make_tiny_model(tiny.tokenizer, seed=3)
    ids = torch.randint(0, model.config.vocab_size, (23,), generator=torch.Generator().manual_seed(1))
    got = model.forward_dense(ids).double()
    want = reference_logits(model, ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
