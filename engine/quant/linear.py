"""Quantized projections and embeddings for CPU decode, on torch's own weight-only kernels.

Decode is memory-bound: every step streams every weight once, so 4-bit weights read 8x fewer bytes
than fp32, and a one-row step's projections run about as many times faster (benchmarks/decode_step.py
profiles them). The kernels' own fp32 paths are scalar loops, so they always get bf16 rows: where the
activations are fp32 (a CPU without native bf16, see kernel_plan.py) the rows are cast at the call.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import ModuleType
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from decodeservice.engine.quant.int4 import Int4Weight, unpack_nibbles
from decodeservice.engine.quant.native import GROUP as DOT_GROUP
from decodeservice.engine.quant.native import TILE_COLUMNS, DotTiles, int4_dot_matmul, tile_codes
from decodeservice.engine.quant.prompt_weights import Int8Copy
from decodeservice.engine.quant.step_rows import PLAIN_ROWS, StepRows, tiled_linear
from decodeservice.engine.quant.w8a8 import W8A8_ROWS, int8_from_int4, quantize_int8, w8a8_mm


def int4_kernels_available() -> bool:
    ops = torch.ops.aten
    return hasattr(ops, "_weight_int4pack_mm_for_cpu") and hasattr(ops, "_convert_weight_to_int4pack_for_cpu")


def int8_kernels_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int8pack_mm")


# What the weight-only kernels are called with: their fp32 paths are scalar loops, many times slower
# than their bf16 ones on AVX-512 and AVX2 alike.
KERNEL_DTYPE = torch.bfloat16
# Below this many weights a matrix's calls are all overhead, so timing the int8-dot kernel against
# torch's would choose by noise: such matrices keep torch's kernel.
DOT_MIN_WEIGHTS = 1 << 16
# Quantized buffers are not persistent: no state_dict round trip needs them, and the model's loader
# checks that every persistent tensor was loaded.


@dataclass(frozen=True, kw_only=True)
class LinearPlan:
    """One quantized projection's routes on this machine, handed to the module at construction (the kernel
    plan, kernel_plan.py, makes one per projection shape; a module built outside an engine takes
    `LinearPlan.default`). `None` turns a path off."""

    w8a8_from: int | None  # rows from which a call takes W8A8 (only where the module has int8 codes)
    # The weight-only route: native.py's int8-dot kernel (Int4Linear only), or None for torch's kernel.
    int8_dot: ModuleType | None = None
    # Which copy of the weights prompt rows run on: none (the weight-only kernel, or W8A8 where on), a
    # oneDNN-packed dense copy, or an int8 copy (prompt_weights.py).
    prompt_copy: Literal["none", "packed", "int8"] = "none"
    # The weight-only kernel failed its self-check (self_check.py): every call it would take runs the plain
    # reference instead, a GEMM on weights dequantized from the project's own codes.
    reference_only: bool = False

    @classmethod
    def default(cls, *, w8a8: bool) -> LinearPlan:
        return cls(w8a8_from=W8A8_ROWS if w8a8 else None)


def int8_dot_fits(out_features: int, in_features: int, group_size: int) -> bool:
    """The int8-dot kernel's shapes: groups of 32, outputs in blocks of 16; and a matrix large enough for a
    timing to mean something (a call on a tiny one is all overhead, and the choice would follow the noise)."""
    return group_size == DOT_GROUP and out_features % TILE_COLUMNS == 0 and in_features * out_features >= DOT_MIN_WEIGHTS


class RowPlanned(nn.Module):
    """A quantized projection with two ways to run a decode or verify call, chosen by its row count:

    - the weight-only kernel (torch's, or native.py's int8 dot where the plan gives it);
    - W8A8, int8 activations x int8 weights (where `w8a8` gave it int8 codes) from `w8a8_from` rows;

    and prompt rows on a copy of the weights where the plan keeps one (prompt_path). The plain reference,
    a GEMM on weights dequantized from the project's own codes, is what the self-check compares with, and
    what every call takes where the weight-only kernel failed it (`reference_only`). The routes are this
    machine's, from the LinearPlan it was built with. Nothing changes them after construction: another
    plan is another module (`with_plan`, sharing the weights)."""

    in_features: int
    out_features: int
    dtype: torch.dtype
    plan: LinearPlan
    # Prompt rows' dense weights, dequantized once and packed for oneDNN (plan.prompt_copy "packed"); None:
    # prompt rows dequantize per call or take the weight-only kernel.
    prompt_weight: torch.Tensor | None = None
    # Prompt rows' int8 copy (prompt_weights.Int8Copy, plan.prompt_copy "int8"); it replaces the dense copy.
    prompt_int8: Int8Copy | None = None

    def _take_plan(self, plan: LinearPlan) -> None:
        """Construction's last step: the routes `plan` gives, and the copies they run on."""
        self.plan = plan if self.has_w8a8 or plan.w8a8_from is None else replace(plan, w8a8_from=None)
        if plan.prompt_copy == "int8":
            self.prompt_int8 = Int8Copy.of(self.dense_weight(torch.float32))
        elif plan.prompt_copy == "packed":
            self.prompt_weight = torch.ops.mkldnn._reorder_linear_weight(self.dense_weight(self.dtype), None)

    def with_plan(self, plan: LinearPlan) -> RowPlanned:
        """This module's weights under another plan: a new module sharing the weight tensors."""
        raise NotImplementedError

    @property
    def w8a8_from(self) -> int | None:
        return self.plan.w8a8_from

    def packed_linear(self, rows: torch.Tensor) -> torch.Tensor:
        assert self.prompt_weight is not None
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(rows, self.prompt_weight, None, "none", [], "")
        return out

    @property
    def has_w8a8(self) -> bool:
        raise NotImplementedError

    def __call__(self, x: torch.Tensor, rows: StepRows = PLAIN_ROWS) -> torch.Tensor:  # typed, no hook dispatch
        return self.forward(x, rows)

    def forward(self, x: torch.Tensor, rows: StepRows = PLAIN_ROWS) -> torch.Tensor:
        """`rows`: the step's row split (step_rows.StepRows), handed down the forward by the runner."""
        # x: (..., K) -> (..., N); the kernels take 2-D contiguous rows
        flat = x.reshape(-1, self.in_features).contiguous()
        out = rows.run(flat, prompt=self.prompt_path, other=self.by_rows, invariant=self.invariant_rows,
                       out_features=self.out_features)
        return out.view(*x.shape[:-1], self.out_features)

    def invariant_rows(self, flat: torch.Tensor) -> torch.Tensor:
        """Deterministic mode's one path for every row (StepRows.deterministic): a row's result is its own
        whatever else the call holds. Here the reference on ROW_TILE-padded rows; Int4Linear takes the
        int8-dot kernel where it has it (each row computed alone: int4_dot.cpp)."""
        return self.reference_rows(flat)

    def reference_rows(self, flat: torch.Tensor) -> torch.Tensor:
        """The plain reference, a GEMM on the weights dequantized per call, on ROW_TILE-padded rows."""
        weight = self.dense_weight(flat.dtype)
        return tiled_linear(flat, lambda rows: F.linear(rows, weight))

    def by_rows(self, flat: torch.Tensor) -> torch.Tensor:
        """Decode and verify rows: the path this machine's plan gives their count."""
        if self.w8a8_from is not None and flat.shape[0] >= self.w8a8_from:
            return self.w8a8(flat)
        if self.plan.reference_only:
            return F.linear(flat, self.dense_weight(flat.dtype))
        return self.weight_only_rows(flat)

    def prompt_path(self, flat: torch.Tensor) -> torch.Tensor:
        """Prompt rows: one path whatever their count (StepRows). The packed dense copy where the plan keeps
        one (prompt_weights.py), called on ROW_TILE-padded rows; else W8A8 where it is on (per-row scales and
        exact integer sums: a row's result is its own); else the weight-only kernel (a row's result is its
        own at every row count: engine/quant/int4_dot.cpp), or the reference on ROW_TILE-padded rows where
        that kernel failed its self-check."""
        if self.prompt_int8 is not None:  # measured faster than the dense copy; a row's result is its own
            return self.prompt_int8(flat)
        if self.prompt_weight is not None:  # measured faster than the routes below (prompt_weights.py)
            return tiled_linear(flat, self.packed_linear)
        if self.w8a8_from is not None:
            return self.w8a8(flat)
        if self.plan.reference_only:
            return self.reference_rows(flat)
        return self.weight_only_rows(flat)

    def weight_only_rows(self, flat: torch.Tensor) -> torch.Tensor:
        """(M, K) rows in the activations' dtype -> (M, N) the same dtype, through the weight-only kernel."""
        return self.weight_only(flat.to(KERNEL_DTYPE)).to(flat.dtype)

    def weight_only(self, flat: torch.Tensor) -> torch.Tensor:
        """(M, K) bf16 -> (M, N) bf16 through the weight-only kernel (torch's, or native.py's int8 dot)."""
        raise NotImplementedError

    def w8a8(self, flat: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dense_weight(self, dtype: torch.dtype, rows: torch.Tensor | None = None) -> torch.Tensor:
        """(N, K) in `dtype` (or only the output `rows` asked for), from the codes in the project's own
        layout (never the kernel's)."""
        raise NotImplementedError


class Int4Linear(RowPlanned):
    """y = x @ W.T with W group-wise 4-bit: the CPU kernel's packed copy for the weight-only path, and
    the codes in our own layout (Int4Weight's nibbles, half a byte a weight; for a tied head the same
    tensor as the embedding's) for the reference and the prompt copies. The kernel's layout differs by
    ISA (AVX-512 and AVX2 pack differently), so nothing here reads it.

    With `w8a8`, also an int8 per-channel copy of the same weights (one byte a weight, on top of the
    half byte of the 4-bit codes) for W8A8 (see engine/quant/w8a8.py).

    Where its plan gives it the int8-dot kernel, the codes are also laid out in that kernel's tiles, and
    torch's packed copy (built at its first use) is never built: the same half byte a weight, in the
    layout that is used."""

    packed: torch.Tensor
    scale_zeros: torch.Tensor
    codes: torch.Tensor
    w8a8_codes: torch.Tensor | None
    w8a8_scales: torch.Tensor | None
    dot_tiles: DotTiles | None = None

    def __init__(self, weight: Int4Weight, *, dtype: torch.dtype = torch.bfloat16, w8a8: bool = False,
                 plan: LinearPlan | None = None) -> None:
        pad = -weight.shape[0] % 64  # see _padding_rows
        # (K/G, N', 2): scale and the kernel's zero, which applies to (code - 8). Our layout too: it is the
        # kernel's input, documented as such, not its private packing.
        scale = F.pad(weight.scale, (0, 0, 0, pad))
        zero = F.pad(weight.offset + 8 * weight.scale, (0, 0, 0, pad))
        scale_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(KERNEL_DTYPE).contiguous()
        codes, scales = int8_from_int4(weight) if w8a8 else (None, None)
        self._build(weight.packed, scale_zeros, weight.group_size, dtype=dtype, w8a8_codes=codes, w8a8_scales=scales,
                    plan=plan or LinearPlan.default(w8a8=w8a8))

    def _build(self, codes: torch.Tensor, scale_zeros: torch.Tensor, group_size: int, *, dtype: torch.dtype,
               w8a8_codes: torch.Tensor | None, w8a8_scales: torch.Tensor | None, plan: LinearPlan,
               packed: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = codes.shape[0], codes.shape[1] * 2
        self.group_size, self.dtype = group_size, dtype
        self.register_buffer("codes", codes, persistent=False)  # (N, K/2) uint8, our layout
        # torch's packed copy, built at its first use (torch_packing): where the plan gives every weight-only
        # call to the int8-dot kernel it is never built, and the load's peak holds one copy of the weights fewer.
        self.register_buffer("packed", codes.new_empty(0) if packed is None else packed, persistent=False)
        self.register_buffer("scale_zeros", scale_zeros, persistent=False)
        self.register_buffer("w8a8_codes", w8a8_codes, persistent=False)  # (N, K) int8
        self.register_buffer("w8a8_scales", w8a8_scales, persistent=False)  # (N,) fp32
        if plan.int8_dot is not None and not (group_size == DOT_GROUP and self.out_features % TILE_COLUMNS == 0):
            raise ValueError(f"the int8-dot kernel cannot run a {self.out_features}x{self.in_features} matrix in "
                             f"groups of {group_size}")
        self.dot_tiles = tile_codes(codes, scale_zeros) if plan.int8_dot is not None else None
        self._take_plan(plan)

    def with_plan(self, plan: LinearPlan) -> Int4Linear:
        module = Int4Linear.__new__(Int4Linear)
        module._build(self.codes, self.scale_zeros, self.group_size, dtype=self.dtype, w8a8_codes=self.w8a8_codes,
                      w8a8_scales=self.w8a8_scales, plan=plan, packed=self.packed)
        return module

    @property
    def int8_dot(self) -> ModuleType | None:
        return self.plan.int8_dot

    def _padding_rows(self) -> int:
        """Rows torch's pack op and its scale_zeros are padded by, one count for both: the op wants N a
        multiple of 16; padding rows have scale 0 and zero 0, and are sliced off the output."""
        return -self.out_features % 64

    def torch_packing(self) -> torch.Tensor:
        """torch's kernel's packed copy of the codes, in whatever layout this ISA gives it (built once)."""
        if self.packed.numel() == 0:
            self.packed = self._pack_for_torch()
        return self.packed

    def _pack_for_torch(self) -> torch.Tensor:
        packed_rows = F.pad(self.codes, (0, 0, 0, self._padding_rows()), value=0x88)  # code 8: 0 once padded
        # The op takes int32 codes, 4 bytes a weight: convert 1024 rows at a time to keep that transient
        # small for the 49k-row head. Row-local packing is checked, not assumed: the kernel plan's self-check
        # compares this module's kernel output with the dense reference at load and falls back if it differs.
        return torch.cat([torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            unpack_nibbles(packed_rows[i : i + 1024]).to(torch.int32), 1) for i in range(0, packed_rows.shape[0], 1024)])

    @property
    def has_w8a8(self) -> bool:
        return self.w8a8_codes is not None

    @property
    def int8_dot_fits(self) -> bool:
        return int8_dot_fits(self.out_features, self.in_features, self.group_size)

    def weight_only_rows(self, flat: torch.Tensor) -> torch.Tensor:
        # The int8-dot kernel takes fp32 rows as they are: on a CPU without native bf16 the round trip
        # through bf16 was two copies per projection (242 of a decode step's copies) for nothing.
        if self.int8_dot is not None and self.dot_tiles is not None:
            return int4_dot_matmul(flat, self.dot_tiles, module=self.int8_dot)
        return super().weight_only_rows(flat)

    def weight_only(self, flat: torch.Tensor) -> torch.Tensor:
        if self.int8_dot is not None and self.dot_tiles is not None:
            return int4_dot_matmul(flat, self.dot_tiles, module=self.int8_dot)
        return self.torch_weight_only(flat)

    def invariant_rows(self, flat: torch.Tensor) -> torch.Tensor:
        if self.int8_dot is not None and self.dot_tiles is not None:
            return int4_dot_matmul(flat, self.dot_tiles, module=self.int8_dot)
        return super().invariant_rows(flat)

    def torch_weight_only(self, flat: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(
            flat, self.torch_packing(), self.group_size, self.scale_zeros)
        return out[:, : self.out_features] if out.shape[1] != self.out_features else out

    def w8a8(self, flat: torch.Tensor) -> torch.Tensor:
        assert self.w8a8_codes is not None and self.w8a8_scales is not None
        return w8a8_mm(flat, self.w8a8_codes, self.w8a8_scales)

    def dense_weight(self, dtype: torch.dtype, rows: torch.Tensor | None = None) -> torch.Tensor:
        k, g = self.in_features, self.group_size
        scale_zeros, packed = self.scale_zeros[:, : self.out_features], self.codes
        if rows is not None:
            scale_zeros, packed = scale_zeros[:, rows], packed[rows]
        n = packed.shape[0]
        scale, zero = scale_zeros.unbind(-1)  # (K/G, N) each
        codes = unpack_nibbles(packed).view(n, k // g, g)
        # In place: one weight-sized buffer, not one per operation (a prompt chunk runs this per layer).
        weight = codes.to(dtype).sub_(8).mul_(scale.t().unsqueeze(-1)).add_(zero.t().unsqueeze(-1))
        return weight.view(n, k)


class Int8Linear(RowPlanned):
    """y = x @ W.T with W int8 and one scale per output channel (symmetric).

    With `w8a8`, calls from `w8a8_from` rows run int8 x int8 on the same codes (no extra memory)."""

    weight_int8: torch.Tensor
    scales: torch.Tensor
    w8a8_scales: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, *, dtype: torch.dtype = torch.bfloat16, w8a8: bool = False,
                 plan: LinearPlan | None = None) -> None:
        codes, scales = quantize_int8(weight)
        scales = scales.to(KERNEL_DTYPE)  # the weight-only kernel's
        # W8A8 scales its int32 sums by the same scales, as rounded for the weight-only kernel, in fp32.
        self._build(codes, scales, scales.float() if w8a8 else None, dtype=dtype,
                    plan=plan or LinearPlan.default(w8a8=w8a8))

    def _build(self, codes: torch.Tensor, scales: torch.Tensor, w8a8_scales: torch.Tensor | None, *,
               dtype: torch.dtype, plan: LinearPlan) -> None:
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.dtype = dtype
        self.register_buffer("weight_int8", codes, persistent=False)  # (N, K)
        self.register_buffer("scales", scales, persistent=False)  # (N,)
        self.register_buffer("w8a8_scales", w8a8_scales, persistent=False)
        if plan.int8_dot is not None:
            raise ValueError("the int8-dot kernel runs 4-bit weights, not int8 ones")
        self._take_plan(plan)

    def with_plan(self, plan: LinearPlan) -> Int8Linear:
        module = Int8Linear.__new__(Int8Linear)
        module._build(self.weight_int8, self.scales, self.w8a8_scales, dtype=self.dtype, plan=plan)
        return module

    @property
    def has_w8a8(self) -> bool:
        return self.w8a8_scales is not None

    def weight_only(self, flat: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.aten._weight_int8pack_mm(flat, self.weight_int8, self.scales)
        return out

    def w8a8(self, flat: torch.Tensor) -> torch.Tensor:
        assert self.w8a8_scales is not None
        return w8a8_mm(flat, self.weight_int8, self.w8a8_scales)

    def dense_weight(self, dtype: torch.dtype, rows: torch.Tensor | None = None) -> torch.Tensor:
        codes, scales = (self.weight_int8, self.scales) if rows is None else (self.weight_int8[rows], self.scales[rows])
        return codes.to(dtype).mul_(scales.to(dtype).unsqueeze(1))
