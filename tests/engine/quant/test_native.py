"""engine/quant/native.py: the C++ dequantization is built here (g++ is on every machine of this
project), agrees with the torch path it replaces, and is refused where it does not.

Runs under the AVX2 caps of scripts/test.sh too, where the kernel is built again with AVX2 flags only."""

from __future__ import annotations

import types

import pytest
import torch

from decodeservice.engine.cpp_extensions import DISABLE_ENV
from decodeservice.engine.quant import Int4Linear, quantize_int4
from decodeservice.engine.quant.kernel_plan import ActivationChoice, plan_kernels, self_check
from decodeservice.engine.quant.native import dequant_extension


def gaussian(rows: int, cols: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def extension() -> types.ModuleType:
    module = dequant_extension()
    assert module is not None, "the native kernel should build wherever g++ and torch's headers are"
    return module


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 100, 192])  # 100: the kernel's copy is padded to 128 rows
def test_native_dequantization_matches_the_torch_path(extension: types.ModuleType, group_size: int,
                                                      rows: int) -> None:
    module = Int4Linear(quantize_int4(gaussian(rows, 256, rows), group_size=group_size))
    for dtype in (torch.float32, torch.bfloat16):
        reference = module.torch_dense_weight(dtype)
        module.native_dequant = extension
        native = module.dense_weight(dtype)
        module.native_dequant = None
        assert native.dtype == dtype and native.shape == reference.shape
        # fp32: a fused multiply-add's last bit at most; bf16: one rounding here, three in torch's ops
        step = reference.float().abs().max().item() * (2**-7 if dtype == torch.bfloat16 else 2**-20)
        torch.testing.assert_close(native.float(), reference.float(), rtol=0, atol=step)


def test_the_plan_runs_the_dense_path_through_it_and_says_so(extension: types.ModuleType, tmp_path: object) -> None:
    model = torch.nn.Module()
    model.proj = Int4Linear(quantize_int4(gaussian(192, 64, 5)), dtype=torch.float32)
    plan = plan_kernels(model, activations=ActivationChoice(dtype=torch.float32, reason="test"),
                        cache_dir=tmp_path)  # type: ignore[arg-type]
    assert model.proj.native_dequant is extension
    assert plan.native_dequant and plan.describe()["native_dequant"] is True


def test_self_check_turns_off_a_native_kernel_that_disagrees(extension: types.ModuleType) -> None:
    class Shifted:  # the real kernel, off by one code step: what a misread layout would look like
        @staticmethod
        def dequantize_int4(codes: torch.Tensor, scale_zeros: torch.Tensor, group: int, out: torch.Tensor) -> None:
            extension.dequantize_int4(codes.roll(1, dims=0).contiguous(), scale_zeros, group, out)

    module = Int4Linear(quantize_int4(gaussian(128, 64, 6)), dtype=torch.float32)
    module.native_dequant = Shifted  # type: ignore[assignment]
    failed = self_check("layers.3.mlp.down_proj", module, dtype=torch.float32)
    assert failed and "native dequantization off" in failed[0] and "layers.3.mlp.down_proj" in failed[0]
    assert module.native_dequant is None
    torch.testing.assert_close(module.dense_weight(torch.float32), module.torch_dense_weight(torch.float32))


def test_it_can_be_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DISABLE_ENV, "0")
    assert dequant_extension.__wrapped__() is None  # the uncached function: the env is read per build
