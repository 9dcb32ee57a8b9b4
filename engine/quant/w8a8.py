"""W8A8 for batches: int8 activations (one scale per row, made per call) x int8 weights (one scale per
output channel), accumulated exactly in int32 by `torch._int_mm` (oneDNN, VNNI where the CPU has it).

    out[m, n] = (sum_k xq[m, k] * wq[n, k]) * row_scale[m] * col_scale[n]

Why: the weight-only kernels dequantize weights per block of rows, so their cost grows linearly with
rows, and at a 32-stream batch torch's int4 kernel takes most of a decode step. An int8 x int8 GEMM pays
no dequantization, and at prompt-chunk sizes it also beats the dense GEMM on a weight dequantized per
call, so prompt chunks take it too where it is on. The figures: benchmarks/decode_step.py
(`projection_rows`) and benchmarks/route_audit.py (`w8a8_int4`, `int8_w8a8`).

Exactness: the int32 sum is exact (K * 127 * 127 < 2**31 for K < 133k), so a row's result depends only
on that row, never on the batch it is in. What the batch changes is which path a row takes: below
`W8A8_ROWS` rows the weight-only kernel runs, from it on this one, and the two round differently
(int8 activations; for int4 weights, an int8 re-quantization of the 4-bit values). Batch-dependent
numerics of this kind are usual in batched serving (vLLM's kernels pick tiles by batch size).
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

import torch

from decodeservice.engine.cpp_extensions import build_extension
from decodeservice.engine.quant.int4 import Int4Weight

ROWS_SOURCE = Path(__file__).with_name("w8a8_rows.cpp")

# From this many rows on a projection runs W8A8 (where its module has int8 codes): the fewest rows at
# which the step as a whole gained, the layers' savings no longer eaten by the head's loss
# (benchmarks/decode_step.py, `projection_rows` in benchmarks/results/decode_step_w8a8_cpu1.json).
# A single sequence's speculative verify reaches it with 5 drafts.
W8A8_ROWS = 6

# Rows converted at a time when an int8 copy is made from 4-bit weights: the fp32 temporaries stay a
# few MB instead of a copy of the whole 49k-row head (113 MB that would add to the load's peak RSS).
_COPY_ROWS = 4096


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: (N, K) int8 codes in [-127, 127] and (N,) fp32 scales."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127).clamp_min(1e-10)
    return (w / scales.unsqueeze(1)).round_().clamp_(-127, 127).to(torch.int8), scales


@functools.cache
def rows_extension() -> ModuleType | None:
    """The native row passes (w8a8_rows.cpp: quantize the rows, scale the sums), one pass each where torch
    makes seven and four; None (logged) where they did not build or differ from torch's ops by one bit."""
    return build_extension(ROWS_SOURCE, what="W8A8 row passes", check=_rows_agree_with_torch, x86_intrinsics=True)


def _native_rows(x: torch.Tensor) -> ModuleType | None:
    """The native passes where they take this call: CPU rows of fp32 or bf16, not inside a compiled step's
    trace (which traces the torch ops: the same bits)."""
    if torch.compiler.is_compiling() or x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return None
    return rows_extension()


def quantize_rows_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.float()  # x itself when x is fp32: not divided in place, the caller's rows stay as they were
    scale = xf.abs().amax(dim=1, keepdim=True).div_(127).clamp_min_(1e-10)
    return torch.div(xf, scale).round_().to(torch.int8), scale


def scale_sums_torch(sums: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor,
                     dtype: torch.dtype) -> torch.Tensor:
    out: torch.Tensor = sums.float().mul_(row_scale).mul_(col_scale).to(dtype)
    return out


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) float -> (M, K) int8 codes in [-127, 127] and (M, 1) fp32 scales (symmetric, per row)."""
    return _quantize_rows(x, _native_rows(x))


def _quantize_rows(x: torch.Tensor, module: ModuleType | None) -> tuple[torch.Tensor, torch.Tensor]:
    if module is None or x.dim() != 2 or not x.is_contiguous():
        return quantize_rows_torch(x)
    codes = torch.empty(x.shape, dtype=torch.int8)
    scales = torch.empty(x.shape[0], 1)
    module.quantize_rows(x, codes, scales)
    return codes, scales


def int8_matmul(x: torch.Tensor, codes_kn: torch.Tensor, col_scale: torch.Tensor) -> torch.Tensor:
    """x (M, K) float @ (codes_kn (K, N) int8 * col_scale (N,) fp32) -> (M, N) in x's dtype: the rows
    quantized per row, the int32 sums exact (`torch._int_mm`: oneDNN, VNNI where the CPU has it)."""
    module = _native_rows(x)
    xq, row_scale = _quantize_rows(x, module)
    sums = torch._int_mm(xq, codes_kn)  # (M, N) int32
    if module is None or not col_scale.is_contiguous() or col_scale.dtype != torch.float32:
        return scale_sums_torch(sums, row_scale, col_scale, x.dtype)
    out = torch.empty(sums.shape, dtype=x.dtype)
    module.scale_sums(sums, row_scale, col_scale, out)
    return out


def w8a8_mm(x: torch.Tensor, codes: torch.Tensor, col_scale: torch.Tensor) -> torch.Tensor:
    """x (M, K) float @ W.T, W = codes (N, K) int8 * col_scale (N,) fp32 -> (M, N) in x's dtype."""
    return int8_matmul(x, codes.t(), col_scale)  # the transposed view is as fast as a (K, N) copy


def _rows_agree_with_torch(module: ModuleType) -> bool:
    """Bit for bit the torch ops: rows of widths with and without a scalar tail, at magnitudes from tiny
    (the 1e-10 floor) to large, an all-zero row, in fp32 and bf16; sums past 2^24 (the int32 -> fp32
    rounding) times scales, into fp32 and bf16."""
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for rows, width in ((1, 576), (37, 576), (5, 1536), (3, 100), (2, 7)):
            for magnitude in (1e-12, 0.02, 1.0, 300.0):
                x = (torch.randn(rows, width, generator=gen) * magnitude).to(dtype)
                x[0, : width // 3] = 0
                if rows > 2:
                    x[1] = 0  # a whole row of zeros: the 1e-10 floor
                codes, scales = torch.empty(x.shape, dtype=torch.int8), torch.empty(rows, 1)
                module.quantize_rows(x, codes, scales)
                want_codes, want_scales = quantize_rows_torch(x)
                if not (torch.equal(codes, want_codes) and torch.equal(scales, want_scales)):
                    return False
        for rows, width in ((1, 960), (33, 3072), (4, 40), (2, 7)):
            sums = torch.randint(-(2**30), 2**30, (rows, width), dtype=torch.int32, generator=gen)
            sums[0, : width // 2] //= 2**12  # small sums too, exact in fp32
            row_scale = torch.rand(rows, 1, generator=gen) * 1e-3
            col_scale = torch.rand(width, generator=gen) * 1e-2
            out = torch.empty(rows, width, dtype=dtype)
            module.scale_sums(sums, row_scale, col_scale, out)
            if not torch.equal(out, scale_sums_torch(sums, row_scale, col_scale, dtype)):
                return False
    return True


def int8_from_int4(weight: Int4Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel int8 codes (N, K) and fp32 scales (N,) of the 4-bit weight's values, a few rows at
    a time. One byte a weight: twice the 4-bit codes' memory."""
    n = weight.shape[0]
    codes, scales = zip(*(quantize_int8(weight.select_rows(torch.arange(i, min(i + _COPY_ROWS, n))).dequantize())
                          for i in range(0, n, _COPY_ROWS)), strict=True)
    return torch.cat(codes), torch.cat(scales)
