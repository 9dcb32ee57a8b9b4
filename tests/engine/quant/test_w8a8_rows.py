"""engine/quant/w8a8_rows.cpp: W8A8's row quantization and its sums' scaling in one native pass each, bit for
bit the torch ops they replace, alone and through the int8 GEMM."""

from __future__ import annotations

import platform
from types import ModuleType

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from decodeservice.engine.quant import w8a8


@pytest.fixture(scope="module")
def module() -> ModuleType:
    built = w8a8.rows_extension()
    if built is None and platform.machine() in ("x86_64", "AMD64") and torch.backends.cpu.get_cpu_capability() != "DEFAULT":
        pytest.fail("the W8A8 row passes did not build or disagreed with torch on an x86 CPU with AVX2")
    if built is None:
        pytest.skip("no AVX2 here: the torch ops run")
    return built


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 16, 512])
def test_the_int8_matmul_gives_the_torch_ops_bits(module: ModuleType, dtype: torch.dtype, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=gen) * 3).to(dtype)
    x[:, ::97] *= 40  # outlier channels, as a transformer's rows have
    codes = torch.randint(-127, 128, (576, 960), dtype=torch.int8, generator=gen)
    col_scale = torch.rand(960, generator=gen) * 1e-2
    xq, row_scale = w8a8.quantize_rows(x)
    want_xq, want_scale = w8a8.quantize_rows_torch(x)
    assert torch.equal(xq, want_xq) and torch.equal(row_scale, want_scale)
    want = w8a8.scale_sums_torch(torch._int_mm(want_xq, codes), want_scale, col_scale, dtype)
    assert torch.equal(w8a8.int8_matmul(x, codes, col_scale), want)


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 9), width=st.integers(1, 200), exponent=st.integers(-40, 40),
       seed=st.integers(0, 2**31 - 1))
def test_quantized_rows_equal_the_torch_ops_at_any_width_and_magnitude(module: ModuleType, rows: int, width: int,
                                                                        exponent: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for dtype in (torch.bfloat16, torch.float32):
        x = (torch.randn(rows, width, generator=gen) * 2.0**exponent).to(dtype)
        codes, scales = torch.empty(x.shape, dtype=torch.int8), torch.empty(rows, 1)
        module.quantize_rows(x, codes, scales)
        want_codes, want_scales = w8a8.quantize_rows_torch(x)
        assert torch.equal(codes, want_codes)
        assert torch.equal(scales, want_scales)


def test_the_check_at_load_refuses_passes_that_differ(module: ModuleType) -> None:
    class OffByOne:
        """The kernel, with the first output of each call one step off."""

        def __getattr__(self, name: str) -> object:
            kernel = getattr(module, name)

            def call(*args: torch.Tensor) -> None:
                kernel(*args)
                out = args[1] if name == "quantize_rows" else args[-1]
                first = out.view(-1)[:1]
                if out.dtype == torch.int8:
                    first.copy_(torch.where(first < 127, first + 1, first - 1))
                else:
                    first.copy_(torch.nextafter(first.float(), torch.tensor(float("inf"))).to(out.dtype))
            return call

    assert w8a8._rows_agree_with_torch(module)
    assert not w8a8._rows_agree_with_torch(OffByOne())  # type: ignore[arg-type]


def test_compiled_steps_and_other_dtypes_take_the_torch_ops(module: ModuleType) -> None:
    assert w8a8._native_rows(torch.zeros(2, 8, dtype=torch.bfloat16)) is module
    assert w8a8._native_rows(torch.zeros(2, 8, dtype=torch.float16)) is None
