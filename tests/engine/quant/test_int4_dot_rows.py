"""The int8-dot kernel at prompt sizes: a call of many rows is split between threads by rows, each thread
quantizing its own, and a row's result must still be the bits it gets alone, at every thread count."""

from __future__ import annotations

import types

import pytest
import torch

from decodeservice.engine.quant import Int4Linear, quantize_int4
from decodeservice.engine.quant.native import (
    _reference_weight,
    int4_dot_extension,
    int4_dot_matmul,
    tile_codes,
)
from decodeservice.engine.quant.self_check import W8A8_TOLERANCE


@pytest.fixture(scope="module")
def int8_dot() -> types.ModuleType:
    module = int4_dot_extension()
    if module is None:
        pytest.skip("the int8-dot kernel needs AVX2 (ATen dispatches below it here)")
    return module


def gaussian(rows: int, cols: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_prompt_sized_call_gives_each_row_its_own_bits_at_every_thread_count(int8_dot: types.ModuleType,
                                                                              dtype: torch.dtype) -> None:
    # 96 outputs: a 32-column task and a 16-column one (AVX-512); 150 rows: split by rows, in chunks with tails.
    module = Int4Linear(quantize_int4(gaussian(96, 576, 1)))
    tiles = tile_codes(module.codes, module.scale_zeros)
    x = (gaussian(150, 576, 2) * torch.linspace(0.1, 4.0, 576)).to(dtype)
    reference = x.float() @ _reference_weight(module.codes, module.scale_zeros).t()
    threads = torch.get_num_threads()
    try:
        calls = {}
        for count in (1, 2):
            torch.set_num_threads(count)
            calls[count] = int4_dot_matmul(x, tiles, module=int8_dot)
            for row in (0, 31, 32, 74, 75, 149):  # chunk and thread boundaries at either count
                assert torch.equal(int4_dot_matmul(x[row:row + 1].contiguous(), tiles, module=int8_dot),
                                   calls[count][row:row + 1])
            assert torch.equal(int4_dot_matmul(x[60:69].contiguous(), tiles, module=int8_dot), calls[count][60:69])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(calls[1], calls[2])
    error = float((calls[1].float() - reference).norm() / reference.norm())
    assert 0 < error < W8A8_TOLERANCE


def test_bf16_rows_come_out_as_their_fp32_results_rounded_to_nearest_even(int8_dot: types.ModuleType) -> None:
    """bf16 and fp32 rows of the same values quantize alike, so the bf16 output is the fp32 one rounded
    (c10's rounding, which the kernel's vectorized store reproduces), at decode and prompt sizes."""
    module = Int4Linear(quantize_int4(gaussian(48, 96, 3)))
    tiles = tile_codes(module.codes, module.scale_zeros)
    for rows in (1, 5, 70):
        x = gaussian(rows, 96, rows).to(torch.bfloat16)
        as_bf16 = int4_dot_matmul(x, tiles, module=int8_dot)
        as_fp32 = int4_dot_matmul(x.float(), tiles, module=int8_dot)
        assert as_bf16.dtype == torch.bfloat16 and torch.equal(as_bf16, as_fp32.to(torch.bfloat16))


def test_a_zero_group_quantizes_to_zero_and_leaves_the_others_alone(int8_dot: types.ModuleType) -> None:
    module = Int4Linear(quantize_int4(gaussian(32, 128, 4)))
    tiles = tile_codes(module.codes, module.scale_zeros)
    x = gaussian(3, 128, 5)
    x[1, 32:64] = 0.0  # a group whose step is 0
    x[2] = 0.0
    out = int4_dot_matmul(x, tiles, module=int8_dot)
    weight = _reference_weight(module.codes, module.scale_zeros)
    assert torch.equal(out[2], torch.zeros(32))
    assert float((out[1] - x[1] @ weight.t()).norm() / (x[1] @ weight.t()).norm()) < W8A8_TOLERANCE
