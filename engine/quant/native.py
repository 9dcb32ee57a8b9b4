"""The int8-dot kernel (int4_dot.cpp): 4-bit weights x int8 activations for the weight-only calls.

Built at first use for the ISA ATen dispatches to and cached (engine/cpp_extensions.py); a build that
fails (no compiler) or a kernel that disagrees with the fp32 product is logged and left out, and torch's
weight-only kernel runs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from decodeservice.engine.cpp_extensions import build_extension

DOT_SOURCE = Path(__file__).with_name("int4_dot.cpp")
GROUP = 32  # the int8-dot kernel's group size: GGUF's Q4_0/Q4_1 block, and quantize_int4's default


@functools.cache
def int4_dot_extension() -> ModuleType | None:
    """The decode-size int4 GEMM on int8 dot products (int4_dot.cpp), or None (logged)."""
    return build_extension(DOT_SOURCE, what="int4 x int8 dot", check=_dot_agrees, x86_intrinsics=True)


TILE_COLUMNS = 16  # output columns per block of the int8-dot kernel's layout


@dataclass(frozen=True)
class DotTiles:
    """4-bit weights in the int8-dot kernel's layout (int4_dot.cpp's header): per block of 16 output
    columns and group of 32 inputs, 4 chunks of 64 bytes, and the block's 16 scales then 16 zeros."""

    codes: torch.Tensor  # (N/16, K/32, 4, 64) uint8
    scales: torch.Tensor  # (N/16, K/32, 2, 16) bf16
    out_features: int


def tile_codes(codes: torch.Tensor, scale_zeros: torch.Tensor) -> DotTiles:
    """(N, K/2) uint8 codes in our layout and their (K/32, N', 2) bf16 scale and zero -> DotTiles.
    N must be a multiple of 16 (Int4Linear.int8_dot_fits)."""
    n, k = codes.shape[0], codes.shape[1] * 2
    blocks, groups = n // TILE_COLUMNS, k // GROUP
    nibbles = torch.stack([codes & 15, codes >> 4], dim=-1).view(blocks, TILE_COLUMNS, groups, 4, 2, 4)
    # (block, column, group, chunk, half, input) -> (block, group, chunk, half, column, input)
    ordered = nibbles.permute(0, 2, 3, 4, 1, 5)
    tiled = (ordered[:, :, :, 0] | (ordered[:, :, :, 1] << 4)).reshape(blocks, groups, 4, 64).contiguous()
    scales = scale_zeros[:, :n].reshape(groups, blocks, TILE_COLUMNS, 2).permute(1, 0, 3, 2).contiguous()
    return DotTiles(codes=tiled, scales=scales, out_features=n)


def int4_dot_matmul(x: torch.Tensor, tiles: DotTiles, *, module: ModuleType) -> torch.Tensor:
    """x (M, K) float32/bf16 @ the 4-bit weights (N, K).T -> (M, N) in x's dtype."""
    if torch.compiler.is_compiling():  # the compiled step (fullgraph) calls it as an op dynamo can trace
        traced: torch.Tensor = _int4_dot_op(x, tiles.codes, tiles.scales)
        return traced
    out = torch.empty(x.shape[0], tiles.out_features, dtype=x.dtype)
    module.int4_matmul(x, tiles.codes, tiles.scales, out)
    return out


@torch.library.custom_op("decodeservice::int4_dot_matmul", mutates_args=())
def _int4_dot_op(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    module = int4_dot_extension()
    assert module is not None, "a module holds dot tiles only where the extension was built"
    out = torch.empty(x.shape[0], codes.shape[0] * TILE_COLUMNS, dtype=x.dtype)
    module.int4_matmul(x, codes, scales, out)
    return out


@_int4_dot_op.register_fake
def _(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], codes.shape[0] * TILE_COLUMNS)


def _reference_weight(codes: torch.Tensor, scale_zeros: torch.Tensor) -> torch.Tensor:
    """The layout's formula in fp32 torch ops, groups of 32: (N, K/2) codes -> (N, K)."""
    n, k = codes.shape[0], codes.shape[1] * 2
    nibbles = torch.stack([codes & 15, codes >> 4], dim=-1).flatten(-2).view(n, k // GROUP, GROUP).float()
    scale, zero = scale_zeros[:, :n].float().unbind(-1)  # (K/G, N)
    return ((nibbles - 8) * scale.t().unsqueeze(-1) + zero.t().unsqueeze(-1)).view(n, k)


def _dot_agrees(module: ModuleType) -> bool:
    """Against the fp32 product on the same codes: int8 activations cost ~1% (W8A8's tolerance)."""
    gen = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 256, (48, 48), dtype=torch.uint8, generator=gen)  # K = 96: 3 groups; 3 blocks
    scale_zeros = (torch.rand(3, 64, 2, generator=gen) * 0.1).to(torch.bfloat16)  # padded, as Int4Linear's
    weight = _reference_weight(codes, scale_zeros)
    x = torch.randn(6, 96, generator=gen)  # a full tile of 4 rows and a partial one
    reference = x @ weight.t()
    tiles = tile_codes(codes, scale_zeros)
    for dtype in (torch.float32, torch.bfloat16):
        value = int4_dot_matmul(x.to(dtype).contiguous(), tiles, module=module).float()
        if not float((value - reference).norm() / reference.norm()) < 0.03:
            return False
    return True
