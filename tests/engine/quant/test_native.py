"""engine/quant/native.py: the C++ int8-dot kernel is built here (g++ is on every
machine of this project), agree with the torch paths they replace, and are refused where they do not.

Runs under the AVX2 caps of scripts/test.sh too, where the kernel is built again with AVX2 flags only."""

from __future__ import annotations

import os
import types
from dataclasses import replace

import pytest
import torch

from decodeservice.engine import cpp_extensions
from decodeservice.engine.cpp_extensions import DISABLE_ENV
from decodeservice.engine.quant import Int4Linear, cpu, quantize_int4
from decodeservice.engine.quant.cpu import detect_cpu
from decodeservice.engine.quant.kernel_plan import ActivationChoice, ProjectionShape, plan_kernels
from decodeservice.engine.quant.linear import LinearPlan
from decodeservice.engine.quant.native import (
    DOT_SOURCE,
    _reference_weight,
    int4_dot_extension,
    int4_dot_matmul,
    tile_codes,
)
from decodeservice.engine.quant.self_check import W8A8_TOLERANCE, self_check


def gaussian(rows: int, cols: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


def test_it_can_be_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DISABLE_ENV, "0")
    assert int4_dot_extension.__wrapped__() is None  # the uncached function: the env is read per build


@pytest.fixture(scope="module")
def int8_dot() -> types.ModuleType:
    module = int4_dot_extension()
    if module is None:
        pytest.skip("the int8-dot kernel needs AVX2 (ATen dispatches below it here)")
    return module


# (48, 96): 3 blocks of 16 outputs (AVX-512 runs two, then one), 3 groups; (1040, 1536): 65 blocks.
@pytest.mark.parametrize("shape", [(192, 128), (48, 96), (64, 576), (1040, 1536)])
def test_int8_dot_kernel_is_as_close_as_w8a8_and_batch_invariant(int8_dot: types.ModuleType,
                                                                  shape: tuple[int, int]) -> None:
    n, k = shape
    module = Int4Linear(quantize_int4(gaussian(n, k, n)))
    x = gaussian(33, k, k).to(torch.bfloat16)
    reference = x.float() @ module.dense_weight(torch.float32).t()
    tiles = tile_codes(module.codes, module.scale_zeros)
    batch = int4_dot_matmul(x, tiles, module=int8_dot)
    error = float((batch.float() - reference).norm() / reference.norm())
    assert error < W8A8_TOLERANCE and error > 0  # int8 activations: close, not exact
    # Every row the same bits whatever the batch it came in: decode, verify and batch agree.
    for rows in (1, 3, 4, 5, 9):
        assert torch.equal(int4_dot_matmul(x[:rows].contiguous(), tiles, module=int8_dot), batch[:rows])


def test_int8_dot_kernel_refuses_shapes_it_cannot_run(int8_dot: types.ModuleType) -> None:
    assert not Int4Linear(quantize_int4(gaussian(1000, 96, 1))).int8_dot_fits  # outputs not in blocks of 16
    assert not Int4Linear(quantize_int4(gaussian(1024, 128, 1), group_size=64)).int8_dot_fits
    module = Int4Linear(quantize_int4(gaussian(64, 96, 1)))
    with pytest.raises(RuntimeError, match="tiles: "):  # tiles of another K
        int4_dot_matmul(gaussian(1, 128, 2), tile_codes(module.codes, module.scale_zeros), module=int8_dot)


def test_self_check_turns_off_an_int8_dot_kernel_that_disagrees(int8_dot: types.ModuleType) -> None:
    class Shifted:  # the real kernel on the wrong rows' codes
        @staticmethod
        def int4_matmul(x: torch.Tensor, codes: torch.Tensor, scale_zeros: torch.Tensor, out: torch.Tensor) -> None:
            int8_dot.int4_matmul(x, codes.roll(1, dims=0).contiguous(), scale_zeros, out)

    module = Int4Linear(quantize_int4(gaussian(128, 64, 7)), dtype=torch.float32,
                        plan=LinearPlan(w8a8_from=None, int8_dot=Shifted))  # type: ignore[arg-type]
    failed, checked = self_check("layers.1.self_attn.o_proj", module, dtype=torch.float32)
    assert failed and "int8-dot kernel off" in failed[0] and module.with_plan(checked).int8_dot is None
    assert failed == [failed[0]]  # torch's kernel, now in use again, passes


def test_the_plan_takes_the_int8_dot_kernel_only_where_it_measured_faster(int8_dot: types.ModuleType,
                                                                          tmp_path: object) -> None:
    projection = ProjectionShape(int4=True, out_features=1536, in_features=576, group_size=32, w8a8=False, head=False)
    plan = plan_kernels([projection], activations=ActivationChoice(dtype=torch.bfloat16, reason="test"),
                        cache_dir=tmp_path)  # type: ignore[arg-type]
    model = torch.nn.Module()
    model.proj = Int4Linear(quantize_int4(gaussian(1536, 576, 8)), plan=plan.linear(projection))
    (shape,) = plan.shapes.values()
    assert (model.proj.int8_dot is int8_dot) == shape.int8_dot
    assert plan.describe()["rows"]["Int4Linear 1536x576"]["weight_only"] == (
        "int8 dot (native)" if shape.int8_dot else "torch int4")
    # Where the int8-dot kernel took over, its tiles replace torch's packed copy (no extra memory), and
    # torch's kernel still runs, from a copy rebuilt from the codes, if asked for.
    model.proj.weight_only(gaussian(1, 576, 9).to(torch.bfloat16))  # torch's copy is built at its kernel's first call
    assert (model.proj.packed.numel() == 0) == shape.int8_dot
    x = gaussian(3, 576, 9).to(torch.bfloat16)
    fresh = Int4Linear(quantize_int4(gaussian(1536, 576, 8)))
    assert torch.equal(model.proj.torch_weight_only(x), fresh.torch_weight_only(x))


def test_the_avx512_build_without_vnni_gives_the_same_bits(int8_dot: types.ModuleType,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """CPUs with AVX-512 but no VNNI (Skylake-SP) run the 512-bit kernel on u8 x s8 pair sums: the same
    integer sums, so the same bits as the VNNI build."""
    here = detect_cpu()
    if not (torch.backends.cpu.get_cpu_capability() == "AVX512" and "avx512_vnni" in here.flags):
        pytest.skip("the default build here already has no VNNI")
    monkeypatch.setattr(cpu, "detect_cpu", lambda: replace(here, flags=here.flags - {"avx512_vnni"}))
    plain = cpp_extensions.build_extension(DOT_SOURCE, what="int4 x int8 dot (no VNNI)", check=lambda _: True,
                                           x86_intrinsics=True)
    assert plain is not None and int8_dot.uses_vnni() and not plain.uses_vnni()
    module = Int4Linear(quantize_int4(gaussian(1040, 576, 10)))
    tiles = tile_codes(module.codes, module.scale_zeros)
    x = gaussian(7, 576, 11).to(torch.bfloat16)
    assert torch.equal(int4_dot_matmul(x, tiles, module=plain), int4_dot_matmul(x, tiles, module=int8_dot))


def test_the_kernels_use_atens_threads(int8_dot: types.ModuleType) -> None:
    """Built without OpenMP, at::parallel_for compiles to a serial loop (it did: the kernel took the same
    time at 2 threads as at 1); the build's flags must keep it on ATen's thread pool."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core here")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert int8_dot.parallel_threads() == 2
    finally:
        torch.set_num_threads(threads)


# Prompt sizes: a call of many rows is split between threads by rows, each thread quantizing its own, and a
# row's result must still be the bits it gets alone, at every thread count.
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
