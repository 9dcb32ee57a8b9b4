"""engine/quant/prompt_weights.py's int8 copy: prompt rows as int8 rows x int8 weights. It must compute what
the weights say (within int8 activations' error), give a prompt row the same bits whatever the number of
rows it came with (a prefix hit's tail against the miss's long chunk), be refused by the load's self-check
when wrong, and be planned only where the CPU's int8 GEMM is exact. Runs under the AVX2 caps too
(scripts/test.sh), where the int8 GEMM is not exact and the plan keeps it off."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from decodeservice.engine.quant import Int4Linear, prompt_weights, quantize_int4
from decodeservice.engine.quant.cpu import int8_gemm_is_exact
from decodeservice.engine.quant.kernel_plan import ActivationChoice, KernelPlan, ProjectionShape, plan_kernels
from decodeservice.engine.quant.linear import LinearPlan
from decodeservice.engine.quant.self_check import self_check


def gaussian(rows: int, cols: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


def int8_module(dtype: torch.dtype) -> Int4Linear:
    # a plan whose prompt route is the weight-only kernel, but for the int8 copy
    module = Int4Linear(quantize_int4(gaussian(96, 128, 0)), dtype=dtype,
                        plan=LinearPlan(w8a8_from=None, prompt_copy="int8"))
    assert module.prompt_int8 is not None
    return module


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prompt_rows_on_the_int8_copy_compute_the_weights_and_their_own_bits_at_any_count(dtype: torch.dtype) -> None:
    if not int8_gemm_is_exact():  # the plan never races it there (the last test): its sums may saturate
        pytest.skip("torch._int_mm is not exact on this dispatch (no VNNI / AMX-INT8 in use)")
    module = int8_module(dtype)
    x = gaussian(40, 128, 1).to(dtype)
    full = module.prompt_path(x)
    assert full.dtype == dtype and full.shape == (40, 96)
    reference = x.float() @ module.dense_weight(torch.float32).t()
    error = float((full.float() - reference).norm() / reference.norm())
    assert error < 0.03  # int8 rows and int8 weights: ~1% each on gaussian data
    for count in (1, 3, 17, 33):  # exact int32 sums and per-row scales: a row's result is its own
        assert torch.equal(module.prompt_path(x[-count:]), full[-count:])
    assert self_check("layers.0.mlp.down_proj", module, dtype=dtype) == ([], module.plan)
    assert module.prompt_int8 is not None
    module = module.with_plan(LinearPlan(w8a8_from=None))
    assert torch.equal(module.prompt_path(x), module.weight_only_rows(x))  # dropped: back on the planned path


def test_a_wrong_int8_copy_is_refused_by_the_self_check() -> None:
    dtype = torch.bfloat16
    module = int8_module(dtype)
    module.prompt_int8 = prompt_weights.Int8Copy.of(module.dense_weight(torch.float32).flip(0).contiguous())
    failed, checked = self_check("layers.0.mlp.down_proj", module, dtype=dtype)
    assert len(failed) == 1 and "int8 prompt copy off" in failed[0]
    assert checked.prompt_copy == "none" and module.with_plan(checked).prompt_int8 is None


def test_the_int8_race_wins_only_by_a_clear_margin() -> None:
    module = Int4Linear(quantize_int4(gaussian(96, 128, 3)), dtype=torch.float32)
    copy = prompt_weights.Int8Copy.of(module.dense_weight(torch.float32))
    x = gaussian(max(prompt_weights.PROMPT_ROWS), 128, 4)
    calls: list[object] = []

    def timer(fn: object) -> float:
        calls.append(fn)
        return 2.0 if len(calls) % 2 else 1.0  # the best route so far 2 ms, the int8 copy 1 ms

    wins, timings = prompt_weights.race_int8(module.prompt_path, copy, x, time_ms=timer)
    assert wins and set(timings) == {"best", "int8"} and set(timings["int8"]) == set(prompt_weights.PROMPT_ROWS)
    tie, _ = prompt_weights.race_int8(module.prompt_path, copy, x, time_ms=lambda fn: 1.0)
    assert not tie


def two_layers(w8a8: bool) -> list[ProjectionShape]:
    return [ProjectionShape(int4=True, out_features=n, in_features=64, group_size=32, w8a8=w8a8, head=head)
            for n, head in ((192, False), (320, True))]


class TwoLayers(nn.Module):
    def __init__(self, plan: KernelPlan, *, w8a8: bool) -> None:
        super().__init__()
        a, head = two_layers(w8a8)
        self.a = Int4Linear(quantize_int4(gaussian(192, 64, 5)), dtype=torch.float32, w8a8=w8a8, plan=plan.linear(a))
        self.lm_head = Int4Linear(quantize_int4(gaussian(320, 64, 6)), dtype=torch.float32, w8a8=w8a8,
                                  plan=plan.linear(head))


@pytest.mark.parametrize("w8a8", [False, True])
def test_the_plan_races_the_int8_copy_only_under_w8a8_where_the_int8_gemm_is_exact(tmp_path: Path, w8a8: bool) -> None:
    activations = ActivationChoice(dtype=torch.float32, reason="test")  # small shapes, fp32: seconds
    plan = plan_kernels(two_layers(w8a8), activations=activations, cache_dir=tmp_path)
    model = TwoLayers(plan, w8a8=w8a8)
    shape = plan.shapes["Int4Linear" + ("+w8a8" if w8a8 else "") + " 192x64"]
    raced = any(path.startswith("prompt_int8_") for path in shape.timings_ms)
    assert raced == (w8a8 and int8_gemm_is_exact())
    assert (model.a.prompt_int8 is not None) == shape.prompt_int8
    assert not (shape.prompt_int8 and model.a.prompt_weight is not None)  # one copy, not both
    assert model.lm_head.prompt_int8 is None  # the head never sees a prompt chunk
    assert plan.describe()["rows"][next(iter(plan.shapes))]["prompt_route"] == shape.prompt_route
