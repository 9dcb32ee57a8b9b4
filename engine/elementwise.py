"""A layer's elementwise steps as one native pass each (elementwise.cpp): RMSNorm (with the residual add
before it), SiLU(gate) * up and the rotary embedding, bit for bit the torch ops they replace; and the greedy
token of each row of a step's logits, torch.max's index.

Built at first use for the ISA ATen dispatches to and cached (engine/cpp_extensions.py). A build that
fails, or one whose results differ from torch's by one bit, is logged and left out: the torch ops run, as
they do inside a compiled step (the graph traces them; they give the same bits) and for other dtypes.
Whether a model takes the passes is decided once, when it is built (`plan_elementwise`, held by the
engine's execution plan), and handed to its modules.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from decodeservice.engine.cpp_extensions import build_extension

SOURCE = Path(__file__).with_name("elementwise.cpp")
DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def elementwise_extension() -> ModuleType | None:
    """The native elementwise passes, or None (logged): the torch ops run."""
    return build_extension(SOURCE, what="elementwise", check=_agrees_with_torch, x86_intrinsics=True)


@dataclass(frozen=True)
class ElementwisePlan:
    """A model's elementwise steps: the native passes (`kernel`) or the torch ops (None), and why."""

    kernel: ModuleType | None
    why: str

    def describe(self) -> dict[str, Any]:
        return {"native": self.kernel is not None, "why": self.why}


TORCH_OPS = ElementwisePlan(kernel=None, why="a model built outside an engine: the torch ops")


def plan_elementwise(device: str, activations: torch.dtype) -> ElementwisePlan:
    """The passes where they run (a CPU, fp32 or bf16 activations, built and equal to torch here)."""
    if torch.device(device).type != "cpu":
        return ElementwisePlan(kernel=None, why=f"the native passes are CPU kernels; {device} runs the torch ops")
    if activations not in DTYPES:
        return ElementwisePlan(kernel=None, why=f"{activations} activations: the native passes take fp32 and bf16")
    kernel = elementwise_extension()
    if kernel is None:
        return ElementwisePlan(kernel=None, why="the native passes did not build here or differed from torch (logged)")
    return ElementwisePlan(kernel=kernel, why="built for this CPU and bit for bit torch's ops at load")


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # fp32 statistics, then one rounding to the activation dtype before the weight, as HF does.
    # (F.rms_norm rounds once, not twice: in bf16 that moved a near-tie in tests/engine/test_quantized.py's
    # speculation check.)
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True).add_(eps))).to(x.dtype)


def silu_and_mul_torch(gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
    gate, up = torch.split(gate_up, intermediate, dim=-1)
    return F.silu(gate) * up


def rotate_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (N, heads, D); x * cos + [-x2, x1] * sin, with sin's first half already negated
    half = x.shape[-1] // 2
    return x * cos + torch.cat([x[..., half:], x[..., :half]], dim=-1) * sin


def _native(kernel: ModuleType | None, x: torch.Tensor) -> ModuleType | None:
    """`kernel` where it takes this call: not inside a compiled step's trace (the torch ops, same bits)."""
    if kernel is None or torch.compiler.is_compiling() or x.device.type != "cpu" or x.dtype not in DTYPES:
        return None
    return kernel


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, kernel: ModuleType | None) -> torch.Tensor:
    """RMSNorm over the last dimension; `weight` may be a shape, e.g. (heads, D) (Qwen3's q/k norms: torch).
    `kernel`: the native passes (ElementwisePlan.kernel), None for the torch ops."""
    module = _native(kernel, x)
    if module is None or x.dim() != 2 or weight.dim() != 1 or weight.dtype != x.dtype or not x.is_contiguous():
        return rms_norm_torch(x, weight, eps)
    out = torch.empty_like(x)
    module.rms_norm(x, weight, eps, out)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 kernel: ModuleType | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, RMSNorm(x + residual)): a layer's residual add and the next norm in one pass."""
    module = _native(kernel, x)
    if (module is None or x.dim() != 2 or weight.dim() != 1 or weight.dtype != x.dtype or residual.dtype != x.dtype
            or not x.is_contiguous() or not residual.is_contiguous()):
        total = x + residual
        return total, rms_norm_torch(total, weight, eps)
    total, out = torch.empty_like(x), torch.empty_like(x)
    module.add_rms_norm(x, residual, weight, eps, total, out)
    return total, out


def silu_and_mul(gate_up: torch.Tensor, intermediate: int, kernel: ModuleType | None) -> torch.Tensor:
    """SiLU(gate) * up of a fused (N, 2I) gate_up projection's rows -> (N, I)."""
    module = _native(kernel, gate_up)
    if module is None or gate_up.dim() != 2 or gate_up.stride(-1) != 1:
        return silu_and_mul_torch(gate_up, intermediate)
    out = gate_up.new_empty(gate_up.shape[0], intermediate)
    module.silu_mul(gate_up, out)
    return out


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kernel: ModuleType | None) -> torch.Tensor:
    """The rotary embedding of (N, heads, D) rows; cos and sin (N, 1, D), sin's first half negated."""
    module = _native(kernel, x)
    if module is None or x.dim() != 3 or cos.dtype != x.dtype or sin.dtype != x.dtype:
        return rotate_torch(x, cos, sin)
    if x.stride(-1) != 1 or x.stride(-2) != x.shape[-1]:
        x = x.contiguous()  # the kernel takes strided rows (a view of the fused qkv rows), not strided heads
    out = torch.empty(x.shape, dtype=x.dtype)
    module.rotate(x, cos.contiguous(), sin.contiguous(), out)
    return out


def greedy_tokens(logits: torch.Tensor, kernel: ModuleType | None) -> torch.Tensor:
    """(S, V) logits -> (S,) int64: each row's first maximal index, a NaN counted as maximal, as
    `logits.max(dim=-1).indices` (several times faster on CPU than `argmax`) gives it."""
    module = _native(kernel, logits)
    if module is None or logits.dim() != 2 or logits.dtype != torch.float32 or not logits.is_contiguous():
        return logits.max(dim=-1).indices
    out = torch.empty(logits.shape[0], dtype=torch.long)
    module.argmax_rows(logits, out)
    return out


def _agrees_with_torch(module: ModuleType) -> bool:
    """Bit for bit torch's ops: every bf16 value through SiLU, random rows whose length leaves a scalar
    tail, the rotation of bf16 and fp32 heads, RMSNorm (with and without the add) over rows of widths
    that exercise its sum's vectors, accumulators and tails, at three magnitudes, and the greedy token
    over rows with ties, NaNs, infinities and signed zeros, in the vectors and in the tail."""
    gen = torch.Generator().manual_seed(0)
    for dtype in DTYPES:
        for rows, width in ((1, 576), (33, 576), (5, 100), (3, 4096), (2, 24)):
            for magnitude in (0.01, 1.0, 40.0):
                x, residual = ((torch.randn(rows, width, generator=gen) * magnitude).to(dtype) for _ in range(2))
                weight = (torch.randn(width, generator=gen) * 0.3 + 1).to(dtype)
                out = torch.empty_like(x)
                module.rms_norm(x, weight, 1e-5, out)
                total, normed = torch.empty_like(x), torch.empty_like(x)
                module.add_rms_norm(x, residual, weight, 1e-6, total, normed)
                expected = x + residual
                if not (torch.equal(out, rms_norm_torch(x, weight, 1e-5)) and torch.equal(total, expected)
                        and torch.equal(normed, rms_norm_torch(expected, weight, 1e-6))):
                    return False
    every_bf16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    every_bf16 = every_bf16[every_bf16.isfinite()]  # 65280 values: 255 rows of 256
    up = torch.randn(every_bf16.numel(), generator=gen).bfloat16()
    cases = [torch.stack([every_bf16, up]).view(2, -1, 256).transpose(0, 1).reshape(-1, 512)]
    for dtype in DTYPES:
        cases += [(torch.randn(7, 2 * width, generator=gen) * 4).to(dtype) for width in (1536, 72, 5)]
    for gate_up in cases:
        out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
        module.silu_mul(gate_up, out)
        if not torch.equal(out, silu_and_mul_torch(gate_up, out.shape[1])):
            return False
    for dtype in DTYPES:
        for heads, d in ((12, 64), (5, 128), (3, 6)):
            x = (torch.randn(9, heads + 1, d, generator=gen) * 3).to(dtype)[:, 1:]  # strided rows, as in the model
            angles = torch.randn(9, 1, d, generator=gen)
            cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
            out = torch.empty_like(x)
            module.rotate(x, cos, sin, out)
            if not torch.equal(out, rotate_torch(x, cos, sin)):
                return False
    for logits in _greedy_cases(gen):
        tokens = torch.empty(logits.shape[0], dtype=torch.long)
        module.argmax_rows(logits, tokens)
        if not torch.equal(tokens, logits.max(dim=-1).indices):
            return False
    return True


def _greedy_cases(gen: torch.Generator) -> list[torch.Tensor]:
    """Rows of logits whose greedy token is each kind of corner: a tie (bf16 values repeat), a NaN before or
    after the maximum, +inf, -inf everywhere, -0 beside +0, the maximum in a row's scalar tail."""
    rows = (torch.randn(12, 1000, generator=gen) * 3).bfloat16().float()
    rows[1, 700] = rows[1, 5] = rows[1].max() + 1  # a tie: the first one
    rows[2, 300] = float("nan")
    rows[3, 10], rows[3, 990] = float("nan"), float("nan")
    rows[4, 555] = float("inf")
    rows[5] = float("-inf")
    rows[6] = 0.0
    rows[6, 3], rows[6, 900] = -0.0, 0.0
    rows[6, :3] = -1.0
    rows[7, 999] = rows[7].max() + 1  # in the scalar tail (1000 is no multiple of the vector)
    rows[8, 998] = float("nan")
    vocabulary = torch.randn(3, 49152, generator=gen).bfloat16().float()
    return [rows, rows[:1, :7].contiguous(), torch.full((2, 49152), -0.0), vocabulary]
