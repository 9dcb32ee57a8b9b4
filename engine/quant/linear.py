"""Quantized projections and embeddings for CPU decode, on torch's own weight-only kernels.

Decode is memory-bound: every step streams every weight once, so 4-bit weights read 8x fewer bytes
than fp32. Measured on 2 cores, all of SmolLM2-135M's projections at one row: fp32 44 ms, bf16 20 ms,
int8 `_weight_int8pack_mm` 9.4 ms, int4 `_weight_int4pack_mm_for_cpu` 4.9 ms, all with bf16
activations; with fp32 activations the two quantized kernels are slower than fp32, hence bf16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from decodeservice.engine.quant.int4 import Int4Weight, unpack_nibbles
from decodeservice.engine.quant.w8a8 import W8A8_ROWS, int8_from_int4, quantize_int8, w8a8_mm


def int4_kernels_available() -> bool:
    ops = torch.ops.aten
    return hasattr(ops, "_weight_int4pack_mm_for_cpu") and hasattr(ops, "_convert_weight_to_int4pack_for_cpu")


def int8_kernels_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int8pack_mm")


# From this many rows on (prompt chunks), Int4Linear dequantizes to a dense GEMM instead of the int4 kernel.
# The int4 kernel's cost is linear in rows from ~4 on (it dequantizes per block of rows); dequantizing a
# whole matrix costs 1.2 (qkv), 4.3 (gate_up), 1.8 (down) ms here, 1 thread. Dequantize + bf16 vs int4:
# 128 rows 1.9 vs 2.0, 7.0 vs 6.4, 3.0 vs 3.2 ms; 256 rows 2.7 vs 4.1, 9.3 vs 12.7, 4.1 vs 6.4 ms. So the
# crossover is 128-256 rows; decode batches (<= 64 rows) never pay for a dequantization.
DENSE_ROWS = 256
# Quantized buffers are not persistent: no state_dict round trip needs them, and the model's loader
# checks that every persistent tensor was loaded.


class Int4Linear(nn.Module):
    """y = x @ W.T with W group-wise 4-bit, in the CPU kernel's packed layout.

    With `w8a8`, also an int8 per-channel copy of the same weights (one byte a weight, on top of the
    half byte of the 4-bit codes): calls of `W8A8_ROWS` rows or more, decode batches and prompt chunks
    alike, run int8 x int8 on it (see engine/quant/w8a8.py), fewer rows keep the 4-bit kernel."""

    packed: torch.Tensor
    scale_zeros: torch.Tensor
    w8a8_codes: torch.Tensor | None
    w8a8_scales: torch.Tensor | None

    def __init__(self, weight: Int4Weight, *, dtype: torch.dtype = torch.bfloat16, w8a8: bool = False) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.group_size = weight.group_size
        # The pack op wants N a multiple of 16; 64 makes its layout uniform (see `dense_weight`). Padding
        # rows have scale 0 and zero 0, and are sliced off the output.
        pad = -self.out_features % 64
        packed_rows = F.pad(weight.packed, (0, 0, 0, pad), value=0x88)  # code 8 = 0 once scale/zero are 0
        # The op takes int32 codes, 4 bytes a weight: convert 1024 rows at a time (the packed layout is
        # row-local, so the pieces concatenate) to keep that transient small for the 49k-row head.
        packed = torch.cat([torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            unpack_nibbles(packed_rows[i : i + 1024]).to(torch.int32), 1) for i in range(0, packed_rows.shape[0], 1024)])
        self.register_buffer("packed", packed, persistent=False)
        # (K/G, N', 2): scale and the kernel's zero, which applies to (code - 8).
        scale = F.pad(weight.scale, (0, 0, 0, pad))
        zero = F.pad(weight.offset + 8 * weight.scale, (0, 0, 0, pad))
        self.register_buffer("scale_zeros", torch.stack([scale.t(), zero.t()], dim=-1).to(dtype).contiguous(),
                             persistent=False)
        codes, scales = int8_from_int4(weight) if w8a8 else (None, None)
        self.register_buffer("w8a8_codes", codes, persistent=False)  # (N, K) int8
        self.register_buffer("w8a8_scales", scales, persistent=False)  # (N,) fp32

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # typed, and no hook dispatch per call
        return self.forward(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (..., K) -> (..., N); the kernel takes 2-D contiguous rows
        flat = x.reshape(-1, self.in_features).contiguous()
        if self.w8a8_codes is not None and self.w8a8_scales is not None and flat.shape[0] >= W8A8_ROWS:
            return w8a8_mm(flat, self.w8a8_codes, self.w8a8_scales).view(*x.shape[:-1], self.out_features)
        if flat.shape[0] >= DENSE_ROWS:
            # A prompt chunk: the int4 kernel's cost grows with rows much faster than a dense GEMM's
            # (3072x576 at 512 rows: 25 ms vs 10 ms bf16 + 3 ms to dequantize), so dequantize once.
            dense: torch.Tensor = F.linear(flat, self.dense_weight()[: self.out_features])
            return dense.view(*x.shape[:-1], self.out_features)
        out: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(
            flat, self.packed, self.group_size, self.scale_zeros)
        if out.shape[1] != self.out_features:
            out = out[:, : self.out_features]
        return out.view(*x.shape[:-1], self.out_features)


    def dense_weight(self) -> torch.Tensor:
        """(N', K) in the activation dtype, read back from the kernel's own layout, so no second copy of
        the codes is kept. That layout (torch 2.13, checked in the tests): blocks of 64 output rows, then
        for each input column 32 bytes, byte j holding row j (low nibble) and row 32 + j (high)."""
        rows, k = self.packed.shape[0], self.in_features
        blocks = self.packed.view(rows // 64, k, 32)
        codes = torch.cat([blocks & 0xF, blocks >> 4], dim=2).transpose(1, 2).reshape(rows, k // self.group_size,
                                                                                      self.group_size)
        scale, zero = self.scale_zeros.unbind(-1)  # (K/G, N') each
        # In place: one weight-sized buffer, not one per operation (a prompt chunk runs this per layer).
        weight = codes.to(self.scale_zeros.dtype).sub_(8).mul_(scale.t().unsqueeze(-1)).add_(zero.t().unsqueeze(-1))
        return weight.view(rows, k)


class Int8Linear(nn.Module):
    """y = x @ W.T with W int8 and one scale per output channel (symmetric).

    With `w8a8`, calls of `W8A8_ROWS` rows or more run int8 x int8 on the same codes (no extra memory;
    at prompt-chunk sizes ~4x faster than the weight-only kernel: gate_up at 512 rows 5.9 vs 25 ms)."""

    weight_int8: torch.Tensor
    scales: torch.Tensor
    w8a8_scales: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, *, dtype: torch.dtype = torch.bfloat16, w8a8: bool = False) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        codes, scales = quantize_int8(weight)
        self.register_buffer("weight_int8", codes, persistent=False)  # (N, K)
        self.register_buffer("scales", scales.to(dtype), persistent=False)  # (N,), the weight-only kernel's
        # W8A8 scales its int32 sums by the same scales, as rounded for the weight-only kernel, in fp32.
        self.register_buffer("w8a8_scales", self.scales.float() if w8a8 else None, persistent=False)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).contiguous()
        if self.w8a8_scales is not None and flat.shape[0] >= W8A8_ROWS:
            return w8a8_mm(flat, self.weight_int8, self.w8a8_scales).view(*x.shape[:-1], self.out_features)
        out: torch.Tensor = torch.ops.aten._weight_int8pack_mm(flat, self.weight_int8, self.scales)
        return out.view(*x.shape[:-1], self.out_features)


class Int4Embedding(nn.Module):
    """Token embedding over 4-bit codes: only the looked-up rows are dequantized."""

    packed: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor

    def __init__(self, weight: Int4Weight, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.shape
        self.group_size, self.dtype = weight.group_size, dtype
        self.register_buffer("packed", weight.packed.contiguous(), persistent=False)  # (V, C/2)
        self.register_buffer("scale", weight.scale.contiguous(), persistent=False)  # (V, C/G)
        self.register_buffer("offset", weight.offset.contiguous(), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # ids: (N,) -> (N, C)
        n, groups = ids.shape[0], self.embedding_dim // self.group_size
        codes = unpack_nibbles(self.packed.index_select(0, ids)).view(n, groups, self.group_size).float()
        rows = codes * self.scale.index_select(0, ids).unsqueeze(-1) + self.offset.index_select(0, ids).unsqueeze(-1)
        return rows.view(n, self.embedding_dim).to(self.dtype)


class Int8Embedding(nn.Module):
    """Token embedding over int8 codes, e.g. the tied head's own: only the looked-up rows are dequantized."""

    codes: torch.Tensor
    scales: torch.Tensor

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = codes.shape
        self.dtype = dtype
        self.register_buffer("codes", codes, persistent=False)  # (V, C) int8; the same tensor as a tied Int8Linear's
        self.register_buffer("scales", scales, persistent=False)  # (V,)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # ids: (N,) -> (N, C)
        codes = self.codes.index_select(0, ids).float()
        return (codes * self.scales.index_select(0, ids).float().unsqueeze(1)).to(self.dtype)
