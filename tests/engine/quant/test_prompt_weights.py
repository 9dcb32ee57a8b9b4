"""engine/quant/prompt_weights.py: prompt rows on a packed dense copy of a projection's weights. The copy
must compute what the weights say, give a prompt row the same bits whatever the number of rows it came
with (a prefix hit's tail against the miss's long chunk), and be refused by the load's self-check when
it is wrong. Runs under the AVX2 caps too (scripts/test.sh), where bf16 has no oneDNN kernel."""

from __future__ import annotations

import pytest
import torch

from decodeservice.engine.quant import Int4Linear, prompt_weights, quantize_int4
from decodeservice.engine.quant.linear import LinearPlan
from decodeservice.engine.quant.self_check import self_check


def gaussian(rows: int, cols: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


def packed_module(dtype: torch.dtype) -> Int4Linear:
    if not prompt_weights.supported(dtype):
        pytest.skip(f"no oneDNN packed linear in {dtype} on this dispatch")
    # a plan whose prompt route is the weight-only kernel, but for the packed copy
    module = Int4Linear(quantize_int4(gaussian(96, 128, 0)), dtype=dtype,
                        plan=LinearPlan(w8a8_from=None, prompt_copy="packed"))
    assert module.prompt_weight is not None
    return module


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prompt_rows_on_the_copy_compute_the_weights_and_their_own_bits_at_any_count(dtype: torch.dtype) -> None:
    module = packed_module(dtype)
    x = gaussian(40, 128, 1).to(dtype)
    full = module.prompt_path(x)
    reference = x.float() @ module.dense_weight(torch.float32).t()
    assert float((full.float() - reference).norm() / reference.norm()) < 0.02
    for count in (1, 3, 17, 33):  # a prefix hit leaves a tail of any length: its rows are the miss's
        assert torch.equal(module.prompt_path(x[-count:]), full[-count:])
    assert self_check("layers.0.mlp.down_proj", module, dtype=dtype) == ([], module.plan)
    assert module.prompt_weight is not None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_wrong_copy_is_refused_by_the_self_check(dtype: torch.dtype) -> None:
    module = packed_module(dtype)
    wrong = module.dense_weight(dtype).flip(0).contiguous()  # the rows of other output channels
    module.prompt_weight = torch.ops.mkldnn._reorder_linear_weight(wrong, None)
    failed, checked = self_check("layers.0.mlp.down_proj", module, dtype=dtype)
    assert len(failed) == 1 and "packed prompt copy off" in failed[0]
    module = module.with_plan(checked)
    assert module.prompt_weight is None
    x = gaussian(8, 128, 2).to(dtype)
    assert torch.equal(module.prompt_path(x), module.weight_only_rows(x))  # back on the planned path


def test_the_race_reports_both_paths_at_prompt_chunk_sizes() -> None:
    dtype = torch.float32
    module = Int4Linear(quantize_int4(gaussian(96, 128, 3)), dtype=dtype)
    x = gaussian(max(prompt_weights.PROMPT_ROWS), 128, 4)
    if not prompt_weights.supported(dtype):
        pytest.skip("no oneDNN packed linear here")
    calls = []

    def timer(fn: object) -> float:
        calls.append(fn)
        return 2.0 if len(calls) % 2 else 1.0  # the prompt path 2 ms, the copy 1 ms: the copy wins

    wins, timings = prompt_weights.race(module.prompt_path, module.dense_weight(dtype), x, time_ms=timer)
    assert wins and set(timings) == {"prompt_path", "packed"}
    assert set(timings["packed"]) == set(prompt_weights.PROMPT_ROWS) and len(calls) == 2 * len(prompt_weights.PROMPT_ROWS)
    lose, _ = prompt_weights.race(module.prompt_path, module.dense_weight(dtype), x, time_ms=lambda fn: 1.0)
    assert not lose  # a tie is not the clear win that the copy's memory must buy
