"""How the kernel plan (kernel_plan.py) times one projection shape's routes, on a module of that shape built
on synthetic weights: W8A8 against the weight-only kernel up a ladder of row counts (where the module has
int8 codes), then prompt rows' copies of the weights against the prompt path as planned
(prompt_weights.py). The result, with the timings that chose it, is the shape's ShapePlan, which the plan
caches. Timings are each the min over repeated runs: on a loaded 2-core machine the min is the figure
time slices disturb least, and a plan measured once is cached for good.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from decodeservice.engine.quant import prompt_weights
from decodeservice.engine.quant.cpu import int8_gemm_is_exact
from decodeservice.engine.quant.linear import RowPlanned

W8A8_LADDER = (2, 4, 6, 8, 12, 16, 32, 64)


@dataclass(frozen=True, kw_only=True)
class ShapePlan:
    """One projection shape's routes as measured, with the timings (ms, per rung) that chose them."""

    w8a8_from: int | None
    timings_ms: dict[str, dict[int, float]] = field(default_factory=dict)
    int8_dot: bool = False  # weight-only calls take native.py's int8-dot kernel, not torch's
    prompt_packed: bool = False  # prompt rows measured faster on a packed dense copy (prompt_weights.py)
    # prompt rows measured faster still on an int8 copy (prompt_weights.Int8Copy); it replaces the dense copy
    prompt_int8: bool = False

    @property
    def prompt_route(self) -> str:
        """Which copy prompt rows run on: "int8", "packed", or "as_planned" (none: the weight-only kernel or W8A8)."""
        return "int8" if self.prompt_int8 else "packed" if self.prompt_packed else "as_planned"


def measure_routes(module: RowPlanned, *, head: bool, dtype: torch.dtype, int8_dot: bool) -> ShapePlan:
    """`module`: the shape's synthetic module with the weight-only kernel it will run (`int8_dot`: the
    int8-dot kernel's, which the plan chose before); `head`: it only sees sampled rows, never a prompt."""
    rows = max(*prompt_weights.PROMPT_ROWS, *W8A8_LADDER)
    x = torch.randn(rows, module.in_features, generator=torch.Generator().manual_seed(1)).to(dtype)
    timings: dict[str, dict[int, float]] = {}
    w8a8_from = None
    if module.has_w8a8:

        def weight_only(x: torch.Tensor) -> Callable[[], object]:
            return lambda: module.weight_only_rows(x)

        def w8a8(x: torch.Tensor) -> Callable[[], object]:
            return lambda: module.w8a8(x)

        with torch.inference_mode():
            timings["weight_only_small"], timings["w8a8"] = race(weight_only, w8a8, x, W8A8_LADDER)
        w8a8_from = first_win(timings["w8a8"], timings["weight_only_small"])
    prompt_packed = prompt_int8 = False
    if not head:
        planned = module.with_plan(replace(module.plan, w8a8_from=w8a8_from))
        best: Callable[[torch.Tensor], torch.Tensor] = planned.prompt_path  # the prompt path as planned
        if prompt_weights.supported(dtype):
            weight = module.dense_weight(dtype)
            prompt_packed, packed_timings = prompt_weights.race(planned.prompt_path, weight, x, time_ms=time_ms)
            timings.update({f"prompt_{path}": rungs for path, rungs in packed_timings.items()})
            if prompt_packed:
                best = prompt_weights.packed_linear(weight)
        # int8 prompt rows quantize the activations, which `--w8a8` opts into: against the bf16 copies
        # they moved the first token's top-5 logprobs by 0.25-0.87 nat (greedy text alike), a
        # quality change the default does not make for speed (benchmarks/prefill_breakdown.py times it).
        # Only where the int8 GEMM is exact: else _int_mm may saturate (no VNNI / AMX-INT8 in use).
        if module.has_w8a8 and int8_gemm_is_exact():
            copy = prompt_weights.Int8Copy.of(module.dense_weight(torch.float32))
            prompt_int8, int8_timings = prompt_weights.race_int8(best, copy, x, time_ms=time_ms)
            timings.update({f"prompt_int8_{path}": rungs for path, rungs in int8_timings.items()})
    return ShapePlan(w8a8_from=w8a8_from, timings_ms=timings, int8_dot=int8_dot, prompt_packed=prompt_packed,
                     prompt_int8=prompt_int8)


def race(incumbent: Callable[[torch.Tensor], Callable[[], object]],
         challenger: Callable[[torch.Tensor], Callable[[], object]], x: torch.Tensor,
         ladder: tuple[int, ...]) -> tuple[dict[int, float], dict[int, float]]:
    """Both paths timed up the ladder, stopping once the challenger has won two rungs running: the
    weight-only kernel's cost grows linearly with rows (it dequantizes per block of rows), the others'
    by less, so a lead taken is kept. This keeps the most expensive rungs out of the start-up."""
    times: tuple[dict[int, float], dict[int, float]] = ({}, {})
    wins = 0
    for rows in ladder:
        times[0][rows], times[1][rows] = time_ms(incumbent(x[:rows])), time_ms(challenger(x[:rows]))
        wins = wins + 1 if times[1][rows] < times[0][rows] else 0
        if wins == 2:
            break
    return times


def first_win(challenger: dict[int, float], incumbent: dict[int, float]) -> int | None:
    """The first rung from which `challenger` is faster at every rung measured above it."""
    first = None
    for rows in sorted(challenger):
        if challenger[rows] < incumbent[rows]:
            first = rows if first is None else first
        else:
            first = None
    return first


def time_ms(fn: Callable[[], object], *, repeats: int = 5, budget_s: float = 0.02, most: int = 200) -> float:
    """Min over at least `repeats` runs, more (up to `most`) until `budget_s` has passed: on a loaded 2-core
    machine a call of tens of microseconds was hit by a time slice in every one of 5 runs (12 ms for a
    0.03 ms call), and a plan measured so is cached for good."""
    fn()  # warm: first-call allocation and oneDNN primitive creation are not the steady state
    best, runs, started = float("inf"), 0, time.perf_counter()
    while runs < repeats or (runs < most and time.perf_counter() - started < budget_s):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
        runs += 1
    return best * 1e3
