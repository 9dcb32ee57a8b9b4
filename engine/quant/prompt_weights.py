"""Prompt rows on a dense copy of a projection's weights, packed once for oneDNN, where it runs faster.

A prompt chunk is hundreds of rows: compute-bound, unlike a decode step, which streams the weights once
and is memory-bound. For such calls the 4-bit codes save nothing and the kernels that read them pay per
row (the int8-dot kernel unpacks and rescales per group of every row; the dense path dequantizes the
whole matrix per call and oneDNN reorders a plain weight per call). A copy dequantized and reordered once
at load runs the chunk as one GEMM at the CPU's dense speed (bf16 AVX-512 or AMX where the CPU has it).

It costs memory: 2 bytes a weight in bf16 (4 in fp32) beside the half byte of the codes. So it is kept
only where the plan measured it faster at prompt-chunk sizes, and only while every copy together stays
within COPY_MAX_BYTES: the bundled SmolLM2-135M's projections are 212 MB in bf16, an 8B model's would be
14 GiB, which a pod sized for its 4-bit weights does not have. Decode rows never read it (their path
keeps the weights' own kernels, memory-bound: the codes' bytes are what they pay for).

Prompt rows take this path whatever their count, padded to whole ROW_TILEs (step_rows.py), so a prefix
hit's tail computes what the miss's long chunk did.

Where the CPU's int8 GEMM is exact (VNNI or AMX-INT8: cpu.int8_gemm_is_exact), the copy may instead be
int8 (`Int8Copy`: one byte a weight, per output channel, of the weights' own values) with the rows
quantized per row to int8 at the call: an int8 x int8 GEMM does twice the multiply-adds of a bf16 one
per instruction on AVX-512 VNNI. A row's int32 sums are exact and its scale is its own, so its result
depends on that row alone (no tiling needed), and the int8-dot kernel that decode rows run already
gives them int8 activations. The plan keeps whichever copy it measured fastest (`race_int8`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from decodeservice.engine.quant.step_rows import tiled_linear
from decodeservice.engine.quant.w8a8 import int8_matmul, quantize_int8

# Rows a prompt chunk has: max_num_batched_tokens' default (512) and half of it (a prompt's last chunk).
PROMPT_ROWS = (256, 512)
# Every copy of a model together: see the module's docstring.
COPY_MAX_BYTES = 512 << 20
# The copy must take at most this share of the prompt path's time at every rung: a start-up measurement
# on a loaded machine moves by 10-20%, and the memory must buy a clear gain.
WINS = 0.85


@functools.cache
def supported(dtype: torch.dtype) -> bool:
    """oneDNN's packed linear on this build, in `dtype` (bf16 needs the CPU's native bf16)."""
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return False
    try:
        weight = torch.randn(32, 64).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        probe = torch.randn(16, 64).to(dtype)
        got = torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
    except (RuntimeError, AttributeError):  # a torch build without these ops, or no bf16 kernel here
        return False
    want = probe.float() @ weight.float().t()
    return bool(torch.allclose(got.float(), want, rtol=3e-2, atol=3e-2))


def copy_bytes(out_features: int, in_features: int, dtype: torch.dtype) -> int:
    return out_features * in_features * torch.empty((), dtype=dtype).element_size()


def packed_linear(dense_weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """(M, K) rows -> (M, N) through a oneDNN-packed copy of the (N, K) `dense_weight`, packed here once."""
    packed = torch.ops.mkldnn._reorder_linear_weight(dense_weight, None)

    def linear(rows: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(rows, packed, None, "none", [], "")
        return out

    return linear


def race(current: Callable[[torch.Tensor], torch.Tensor], dense_weight: torch.Tensor, x: torch.Tensor, *,
         time_ms: Callable[[Callable[[], object]], float]) -> tuple[bool, dict[str, dict[int, float]]]:
    """The prompt path as it is (`current`) against the packed copy of `dense_weight` (N, K), at each of
    PROMPT_ROWS rows of `x`: whether the copy wins at every rung by WINS' margin, and the timings (ms)."""
    packed = packed_linear(dense_weight)
    timings: dict[str, dict[int, float]] = {"prompt_path": {}, "packed": {}}
    with torch.inference_mode():
        for rows in PROMPT_ROWS:
            chunk = x[:rows]
            timings["prompt_path"][rows] = time_ms(lambda: current(chunk))  # noqa: B023 (called at once)
            timings["packed"][rows] = time_ms(lambda: tiled_linear(chunk, packed))  # noqa: B023
    wins = all(timings["packed"][r] < WINS * timings["prompt_path"][r] for r in PROMPT_ROWS)
    return wins, timings


@dataclass(frozen=True, kw_only=True)
class Int8Copy:
    """Prompt rows' int8 copy of a projection: y = (int8(x) @ codes) * row_scale * scales."""

    codes: torch.Tensor  # (K, N) int8: _int_mm's (K, N) operand contiguous, not a transposed (N, K) view
    scales: torch.Tensor  # (N,) fp32, per output channel

    @classmethod
    def of(cls, dense_weight: torch.Tensor) -> Int8Copy:
        """From the (N, K) dense weight (fp32: the weights' own values, dequantized from their codes)."""
        codes, scales = quantize_int8(dense_weight)
        return cls(codes=codes.t().contiguous(), scales=scales)

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + 4 * self.scales.numel()

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        """(M, K) float -> (M, N) in the rows' dtype."""
        return int8_matmul(rows, self.codes, self.scales)


def race_int8(best: Callable[[torch.Tensor], torch.Tensor], copy: Int8Copy, x: torch.Tensor, *,
              time_ms: Callable[[Callable[[], object]], float]) -> tuple[bool, dict[str, dict[int, float]]]:
    """The fastest prompt route so far (`best`: the packed copy where it won `race`, else the prompt path as
    planned) against the int8 copy at each of PROMPT_ROWS rows of `x`: whether the int8 copy wins at every
    rung by WINS' margin, and the timings (ms)."""
    timings: dict[str, dict[int, float]] = {"best": {}, "int8": {}}
    with torch.inference_mode():
        for rows in PROMPT_ROWS:
            chunk = x[:rows]
            timings["best"][rows] = time_ms(lambda: best(chunk))  # noqa: B023 (called at once)
            timings["int8"][rows] = time_ms(lambda: copy(chunk))  # noqa: B023
    wins = all(timings["int8"][r] < WINS * timings["best"][r] for r in PROMPT_ROWS)
    return wins, timings
