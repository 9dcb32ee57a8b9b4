"""Group-wise 4-bit weights: quantized at load time from any float weight, or read straight from a
GGUF Q4_0/Q4_1 tensor without a trip through fp32.

One layout for both: w[n, g*G + j] = code[n, g*G + j] * scale[n, g] + offset[n, g], codes in 0..15.
GGUF Q4_1 is exactly that (scale d, offset m); Q4_0 is d * (code - 8), i.e. offset = -8d.
torch's CPU int4 kernel (`_weight_int4pack_mm_for_cpu`) computes (code - 8) * scale + zero, so its
zero is offset + 8 * scale (checked numerically in tests/engine/test_quantized.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

GGUF_BLOCK = 32  # Q4_0 and Q4_1 both quantize groups of 32 values
_Q4_0_BYTES, _Q4_1_BYTES = 18, 20  # per block: f16 d [+ f16 m] + 16 bytes of nibbles


@dataclass(frozen=True, kw_only=True)
class Int4Weight:
    """An (N, K) weight as 4-bit codes with one fp32 scale and offset per group of `group_size`."""

    packed: torch.Tensor  # (N, K/2) uint8: column 2i in the low nibble, 2i+1 in the high one
    scale: torch.Tensor  # (N, K/G) float32
    offset: torch.Tensor  # (N, K/G) float32
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * 2

    def codes(self) -> torch.Tensor:
        """(N, K) uint8 codes in 0..15."""
        return unpack_nibbles(self.packed)

    def dequantize(self) -> torch.Tensor:
        """(N, K) float32."""
        n, k = self.shape
        codes = self.codes().view(n, k // self.group_size, self.group_size).float()
        return (codes * self.scale.unsqueeze(-1) + self.offset.unsqueeze(-1)).view(n, k)

    def select_rows(self, index: torch.Tensor) -> Int4Weight:
        return Int4Weight(packed=self.packed[index], scale=self.scale[index], offset=self.offset[index],
                          group_size=self.group_size)

    @staticmethod
    def cat(parts: Sequence[Int4Weight]) -> Int4Weight:
        """Stack along the output rows (fused q/k/v, gate/up)."""
        groups = {p.group_size for p in parts}
        assert len(groups) == 1, "fused weights share one group size"
        return Int4Weight(packed=torch.cat([p.packed for p in parts]), scale=torch.cat([p.scale for p in parts]),
                          offset=torch.cat([p.offset for p in parts]), group_size=groups.pop())


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """(..., K/2) uint8 -> (..., K) uint8."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """(..., K) uint8 codes in 0..15 -> (..., K/2) uint8."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()


def quantize_int4(weight: torch.Tensor, *, group_size: int = 32) -> Int4Weight:
    """Asymmetric min/max quantization of each group of `group_size` inputs of each output row."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"in_features {k} is not a multiple of the int4 group size {group_size}")
    parts = [_quantize_rows(weight[i : i + QUANTIZE_ROWS], group_size) for i in range(0, n, QUANTIZE_ROWS)]
    return parts[0] if len(parts) == 1 else Int4Weight.cat(parts)


# Rows quantized at a time: the float temporaries stay a few MB instead of a copy of the whole matrix
# (the 49k-row embedding/head: 113 MB of fp32 that would add to the load's peak RSS).
QUANTIZE_ROWS = 4096


def _quantize_rows(weight: torch.Tensor, group_size: int) -> Int4Weight:
    n, k = weight.shape
    groups = weight.detach().float().reshape(n, k // group_size, group_size)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / 15).clamp_min(1e-10)  # a constant group gets codes 0 and its value as offset
    codes = ((groups - low.unsqueeze(-1)) / scale.unsqueeze(-1)).round_().clamp_(0, 15).to(torch.uint8)
    return Int4Weight(packed=pack_nibbles(codes.view(n, k)), scale=scale, offset=low, group_size=group_size)


def int4_from_gguf(data: np.ndarray, *, is_q4_1: bool, shape: tuple[int, int]) -> Int4Weight:
    """A Q4_0 or Q4_1 tensor's raw bytes (rows of blocks) -> Int4Weight, no float weights made.

    A block stores f16 d, (Q4_1) f16 m, then 16 bytes: value j in the low nibble of byte j, value
    j+16 in the high nibble of byte j."""
    n, k = shape
    block_bytes = _Q4_1_BYTES if is_q4_1 else _Q4_0_BYTES
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(n, k // GGUF_BLOCK, block_bytes)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if is_q4_1:
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    else:
        m = -8.0 * d
    qs = blocks[..., block_bytes - 16:]  # (n, k/32, 16)
    codes = np.concatenate([qs & 0xF, qs >> 4], axis=-1).reshape(n, k)  # block order: j, then j+16
    return Int4Weight(packed=pack_nibbles(torch.from_numpy(codes)), scale=torch.from_numpy(d),
                      offset=torch.from_numpy(m), group_size=GGUF_BLOCK)
