"""The load-time self-check of a quantized projection's fast paths (kernel_plan.py runs it on every shape
it plans): each path its LinearPlan gives is compared with the dense reference from the project's own
codes, and one that disagrees is turned off in the plan the modules of that shape are then built with."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F

from decodeservice.engine.quant.linear import LinearPlan, RowPlanned

# Relative L2 error a fast path may have against the fp32 reference on the same codes: bf16 rows and
# outputs are ~0.4% each; int8 activations add ~1% (W8A8). A misread layout is ~100%.
WEIGHT_ONLY_TOLERANCE, W8A8_TOLERANCE = 0.03, 0.08
CHECK_ROWS = 64  # output rows compared per module, spread over the matrix

def self_check(name: str, module: RowPlanned, *, dtype: torch.dtype) -> tuple[list[str], LinearPlan]:
    """Compare the fast paths `module.plan` gives with the dense reference on CHECK_ROWS of its output rows.
    Returns what disagreed, and the plan with those paths off (the module itself is left as built)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, module.in_features, generator=gen)  # 8 rows: W8A8 and the kernel's multi-row blocks
    index = torch.linspace(0, module.out_features - 1, min(CHECK_ROWS, module.out_features)).round().long()
    index = torch.unique_consecutive(index)
    reference = F.linear(x, module.dense_weight(torch.float32, index))  # (8, len(index)) fp32
    failed: list[str] = []
    plan = module.plan

    def error(path: Callable[[torch.Tensor], torch.Tensor]) -> float:
        return _relative_error(path(x.to(dtype)).float()[:, index], reference)

    dot_passed = False
    if plan.int8_dot is not None:
        err = error(module.weight_only_rows)
        dot_passed = err < W8A8_TOLERANCE  # int8 activations, as W8A8's
        if not dot_passed:
            failed.append(f"{name}: int8-dot kernel off (relative error {err:.3g})")
            plan = replace(plan, int8_dot=None)  # torch's kernel takes the weight-only calls: check it next
            module = module.with_plan(replace(plan, prompt_copy="none"))
    if not dot_passed:
        err = error(module.weight_only_rows)
        if not err < WEIGHT_ONLY_TOLERANCE:  # also catches NaN
            failed.append(f"{name}: weight-only kernel off, the reference runs (relative error {err:.3g})")
            plan = replace(plan, reference_only=True)
    if module.prompt_weight is not None:
        err = error(module.packed_linear)
        if not err < WEIGHT_ONLY_TOLERANCE:
            failed.append(f"{name}: packed prompt copy off (relative error {err:.3g})")
            plan = replace(plan, prompt_copy="none")
    if module.prompt_int8 is not None:
        err = error(module.prompt_int8)
        if not err < W8A8_TOLERANCE:  # int8 activations, as W8A8's
            failed.append(f"{name}: int8 prompt copy off (relative error {err:.3g})")
            plan = replace(plan, prompt_copy="none")
    if plan.w8a8_from is not None:
        err = error(module.w8a8)
        if not err < W8A8_TOLERANCE:
            failed.append(f"{name}: W8A8 off (relative error {err:.3g})")
            plan = replace(plan, w8a8_from=None)
    return failed, plan


def _relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    return float((value - reference).norm() / reference.norm().clamp_min(1e-12))
