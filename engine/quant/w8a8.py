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

import torch

from decodeservice.engine.quant.int4 import Int4Weight

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


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) float -> (M, K) int8 codes in [-127, 127] and (M, 1) fp32 scales (symmetric, per row)."""
    xf = x.float()  # x itself when x is fp32: not divided in place, the caller's rows stay as they were
    scale = xf.abs().amax(dim=1, keepdim=True).div_(127).clamp_min_(1e-10)
    return torch.div(xf, scale).round_().to(torch.int8), scale


def w8a8_mm(x: torch.Tensor, codes: torch.Tensor, col_scale: torch.Tensor) -> torch.Tensor:
    """x (M, K) float @ W.T, W = codes (N, K) int8 * col_scale (N,) fp32 -> (M, N) in x's dtype."""
    xq, row_scale = quantize_rows(x)
    acc = torch._int_mm(xq, codes.t())  # (M, N) int32; the transposed view is as fast as a (K, N) copy
    out: torch.Tensor = acc.float().mul_(row_scale).mul_(col_scale).to(x.dtype)
    return out


def int8_from_int4(weight: Int4Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel int8 codes (N, K) and fp32 scales (N,) of the 4-bit weight's values, a few rows at
    a time. One byte a weight: twice the 4-bit codes' memory."""
    n = weight.shape[0]
    codes, scales = zip(*(quantize_int8(weight.select_rows(torch.arange(i, min(i + _COPY_ROWS, n))).dequantize())
                          for i in range(0, n, _COPY_ROWS)), strict=True)
    return torch.cat(codes), torch.cat(scales)
