"""This machine's kernels for a quantized model, chosen at load by capability and measurement.

    activations = choose_activations(detect_cpu(), hidden=576, intermediate=1536)   # bf16 or fp32
    plan = plan_kernels(shapes, activations=activations)  # shapes: the ProjectionShape of each module to build
    Int4Linear(weight, dtype=activations.dtype, plan=plan.linear(shape))   # the loader builds each so

Two choices, each made here for the CPU this runs on, never from constants measured on another box:
1. Activation (and KV cache) dtype: bf16 only where the CPU has native bf16 (cpu.py) AND a bf16 GEMM
   at the model's own prompt-chunk shape measures faster than fp32; else fp32, with the weight-only
   kernels still called with bf16 rows (their fp32 paths are scalar loops).
2. Per projection shape, its routes (kernel_race.py): the int8-dot kernel or torch's for weight-only
   calls, from how many rows a call leaves the weight-only kernel for W8A8 (where on), and which copy
   of the weights prompt rows run on, each raced on one module of that shape.

Measurements are cached per CPU model, ISA caps, thread count, torch version and model shapes
(plan_cache.py), so a restart does not pay again.
Every load, whatever the cache says, each shape's fast paths are compared with the dense reference (from
the project's own codes) on a spread of its output rows; a path that disagrees is turned off for that
shape and logged, and its modules are built on the next path. Timings and checks run on synthetic weights
of each shape (ProjectionShape.synthetic), before the model's quantized modules exist: a kernel's time
depends on the shape, not the values, and a misread layout or a wrong kernel shows on any weights. So
each module receives its finished plan at construction and nothing is set on it afterwards.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from decodeservice.engine.quant import prompt_weights
from decodeservice.engine.quant.cpu import CpuCapability, detect_cpu, int8_gemm_is_exact
from decodeservice.engine.quant.int4 import Int4Weight
from decodeservice.engine.quant.kernel_race import ShapePlan, measure_routes, time_ms
from decodeservice.engine.quant.linear import (
    KERNEL_DTYPE,
    Int4Linear,
    Int8Linear,
    LinearPlan,
    RowPlanned,
    int8_dot_fits,
)
from decodeservice.engine.quant.native import int4_dot_extension
from decodeservice.engine.quant.plan_cache import plan_cache_path, read_cached, write_cached
from decodeservice.engine.quant.self_check import self_check

log = logging.getLogger("decodeservice.engine.kernels")
# Where the int8-dot kernel must win to replace torch's, and by how much: rows -> its most time as a
# fraction of torch's. A verify's or a batch's 8 rows add compute, where a clear win must pay for the
# int8 activations' accuracy (~1% per projection), so a tie there goes to torch's kernel. One row is a
# decode, memory-bound for both (the same bytes): there it must only not lose. Both bars are met with
# room on either dispatch (benchmarks/int4_kernels.py: benchmarks/results/int4_kernels_*.json).
DOT_WINS = {1: 1.0, 8: 0.8}
# A CPU that reports native bf16 runs fp32 only if its bf16 GEMM is this much slower than fp32: hardware
# bf16 measures ~0.2x fp32 here (AMX), emulated ~10x (oneDNN capped at AVX2), and a loaded 2-core machine
# moved single timings by up to 2x, which must not flip the dtype between restarts.
BF16_LOSS, BF16_ROUNDS = 3.0, 4


@dataclass(frozen=True, kw_only=True)
class ActivationChoice:
    dtype: torch.dtype
    reason: str


@dataclass(frozen=True, kw_only=True)
class KernelPlan:
    cpu: CpuCapability
    activations: ActivationChoice
    shapes: dict[str, ShapePlan]  # as measured (or cached), by ProjectionShape.key
    linears: dict[str, LinearPlan]  # what each module of that shape is built with, self-checked
    source: str  # "measured" or the cache file it came from
    fallbacks: tuple[str, ...]  # "module: path turned off (error)" for each failed self-check
    seconds: float
    prompt_copy_bytes: int = 0  # the packed dense copies prompt rows run on (prompt_weights.py), together
    # Planned for deterministic mode: the int8-dot kernel (rows computed alone) on every module it fits,
    # whatever the race said, since every row of that mode takes it (linear.RowPlanned.invariant_rows).
    deterministic: bool = False

    def linear(self, shape: ProjectionShape) -> LinearPlan:
        """The plan a module of `shape` is built with (the loader's; one of the shapes planned)."""
        return self.linears[shape.key]

    def describe(self) -> dict[str, Any]:
        """What the engine logs at start-up and serves in /v1/models."""
        return {
            "cpu": self.cpu.describe(),
            "activations": str(self.activations.dtype).removeprefix("torch."),
            "activations_reason": self.activations.reason,
            # the dtype each weight-only kernel takes its rows in: torch's bf16, the int8-dot kernel as they are
            "weight_only_kernel_rows": {"torch int4": str(KERNEL_DTYPE).removeprefix("torch."),
                                        "int8 dot (native)": str(self.activations.dtype).removeprefix("torch.")},
            # the routes each shape's modules were built with: measured, then self-checked
            "rows": {key: {"weight_only": "reference (self-check)" if p.reference_only else
                           "int8 dot (native)" if p.int8_dot is not None else "torch int4",
                           "w8a8_from": p.w8a8_from, "prompt_packed": p.prompt_copy == "packed",
                           "prompt_route": {"none": "as_planned"}.get(p.prompt_copy, p.prompt_copy)}
                     for key, p in self.linears.items()},
            "prompt_copy_bytes": self.prompt_copy_bytes,
            "deterministic": self.deterministic,
            "source": self.source,
            "self_check_fallbacks": list(self.fallbacks),
            "plan_seconds": round(self.seconds, 3),
        }


def choose_activations(cpu: CpuCapability, *, hidden: int, intermediate: int,
                       cache_dir: Path | None = None) -> ActivationChoice:
    """bf16 where this CPU runs it natively, confirmed by a GEMM at (at least) the model's shape; else fp32.
    The GEMM rounds' verdict is cached beside the kernel plans, so a restart (or a draft model) does
    not pay them again."""
    if not cpu.native_bf16:
        return ActivationChoice(dtype=torch.float32, reason=(
            f"no native bf16 here (ATen {cpu.aten}, oneDNN cap {cpu.onednn_max_isa or 'none'}): fp32 activations "
            "(the KV cache: int8 rows under kv_cache_dtype auto), bf16 only at the calls of torch's weight-only kernels"))
    k, n = max(hidden, 1024), max(intermediate, 1024)
    cache = plan_cache_path(cache_dir, cpu, torch.bfloat16, [f"activations {k}x{n}"], prefix="activations")
    raw = read_cached(cache, lambda raw: (getattr(torch, raw["dtype"]), str(raw["reason"])))
    if raw is not None:
        dtype, reason = raw
        return ActivationChoice(dtype=dtype, reason=f"{reason} (cached: {cache})")
    choice = _measure_activations(k=k, n=n)
    write_cached(cache, {"dtype": str(choice.dtype).removeprefix("torch."), "reason": choice.reason})
    return choice


def _measure_activations(*, k: int, n: int) -> ActivationChoice:
    # The GEMM tells hardware bf16 from emulated (~0.2x vs ~10x fp32's time), not shape effects: a tiny
    # model's GEMM would measure overheads, hence the floor. Only a loss in every one of several
    # interleaved rounds overrules the flags: on a loaded 2-core machine single timings moved 2-20x, and
    # the dtype must not flip between restarts with the neighbours' load.
    rounds = [(_gemm_ms(torch.bfloat16, rows=256, k=k, n=n), _gemm_ms(torch.float32, rows=256, k=k, n=n))
              for _ in range(BF16_ROUNDS)]
    ratio = min(bf16 / fp32 for bf16, fp32 in rounds)
    bf16_ms, fp32_ms = min(b for b, _ in rounds), min(f for _, f in rounds)
    measured = (f"a {k}x{n} GEMM at 256 rows measured bf16 {bf16_ms:.2f} ms vs fp32 {fp32_ms:.2f} ms "
                f"(best of {BF16_ROUNDS} rounds; lowest bf16/fp32 ratio {ratio:.2f})")
    if ratio > BF16_LOSS:
        return ActivationChoice(dtype=torch.float32, reason=f"the CPU reports bf16 but {measured}: fp32 activations")
    return ActivationChoice(dtype=torch.bfloat16, reason=(
        f"native bf16; {measured}: bf16 activations and KV cache (half the bytes)"))


@dataclass(frozen=True, kw_only=True)
class ProjectionShape:
    """A quantized projection as the loader will build it: all the plan needs, before any is built."""

    int4: bool  # Int4Linear, else Int8Linear
    out_features: int
    in_features: int
    group_size: int  # the 4-bit codes' (the int8-dot kernel takes groups of 32 only)
    w8a8: bool
    head: bool  # the head only sees sampled rows, never a prompt chunk

    @property
    def key(self) -> str:
        kind = ("Int4Linear" if self.int4 else "Int8Linear") + ("+w8a8" if self.w8a8 else "") + (" head" if self.head else "")
        return f"{kind} {self.out_features}x{self.in_features}"

    def synthetic(self, *, dtype: torch.dtype, plan: LinearPlan | None = None) -> RowPlanned:
        """A module of this shape on random weights, to time and check kernels on: their time depends on the
        shapes, not the values, and a misread layout or a wrong kernel shows on any weights."""
        gen = torch.Generator().manual_seed(self.out_features * 7 + self.in_features)
        n, k = self.out_features, self.in_features
        if not self.int4:
            return Int8Linear(torch.randn(n, k, generator=gen), dtype=dtype, w8a8=self.w8a8, plan=plan)
        scale = torch.rand(n, k // self.group_size, generator=gen) * 0.02 + 0.001
        weight = Int4Weight(packed=torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen),
                            scale=scale, offset=-8 * scale, group_size=self.group_size)
        return Int4Linear(weight, dtype=dtype, w8a8=self.w8a8, plan=plan)


def plan_kernels(shapes: Sequence[ProjectionShape], *, activations: ActivationChoice, cpu: CpuCapability | None = None,
                 cache_dir: Path | None = None, deterministic: bool = False, compiled: bool = False) -> KernelPlan:
    """Measure (or read from the cache) each projection shape's routes, then self-check each shape's
    fast paths, before any quantized module is built: the loader builds each with `plan.linear(shape)`.
    `shapes`: one per module to be built. `deterministic` (EngineConfig.deterministic) gives the int8-dot
    kernel to every shape it fits, raced or not. `compiled` (EngineConfig.compile): the step runs through
    inductor, which cannot lower oneDNN's packed linear inside its graph, so no prompt copy is packed."""
    started = time.perf_counter()
    cpu = cpu or detect_cpu()
    groups: dict[str, list[ProjectionShape]] = {}
    for shape in shapes:
        groups.setdefault(shape.key, []).append(shape)
    fits = {key: same[0].int4 and int8_dot_fits(same[0].out_features, same[0].in_features, same[0].group_size)
            for key, same in groups.items()}
    dot = int4_dot_extension() if any(fits.values()) else None
    cache = plan_cache_path(cache_dir, cpu, activations.dtype, [*sorted(groups), f"int8 dot {dot is not None}"])
    measured = _read_cache(cache)
    source = str(cache) if measured is not None else "measured"
    if measured is None:
        measured = {key: _measure(same[0], dtype=activations.dtype, dot=dot if fits[key] else None)
                    for key, same in groups.items()}
        _write_cache(cache, measured)
    if deterministic and dot is not None:
        measured = {key: replace(p, int8_dot=p.int8_dot or fits[key]) for key, p in measured.items()}
    fallbacks: list[str] = []
    # All the prompt copies the plan wants, or none (the memory rule: prompt_weights.py); deterministic
    # mode's rows all take one other path, and a compiled step cannot run them, so both keep none.
    wanted = sum(prompt_weights.copy_bytes(s.out_features, s.in_features,
                                           torch.int8 if measured[key].prompt_int8 else activations.dtype)
                 for key, same in groups.items() if measured[key].prompt_route != "as_planned" for s in same)
    packing, copy_bytes = not deterministic and not compiled and wanted <= prompt_weights.COPY_MAX_BYTES, 0
    if any(s.w8a8 for s in shapes) and not int8_gemm_is_exact():
        fallbacks.append("W8A8 off everywhere: torch._int_mm is not exact on this CPU (no VNNI/AMX-INT8 in use)")
        measured = {key: replace(p, w8a8_from=None) for key, p in measured.items()}
    if any(p.prompt_int8 for p in measured.values()) and not int8_gemm_is_exact():  # never measured so; checked
        measured = {key: replace(p, prompt_int8=False) for key, p in measured.items()}
    linears: dict[str, LinearPlan] = {}
    for key, same in groups.items():
        p, shape = measured[key], same[0]
        proposed = LinearPlan(w8a8_from=p.w8a8_from, int8_dot=dot if p.int8_dot and fits[key] else None,
                              prompt_copy="int8" if packing and p.prompt_int8 else
                              "packed" if packing and p.prompt_packed else "none")
        failed, linears[key] = self_check(key, shape.synthetic(dtype=activations.dtype, plan=proposed),
                                          dtype=activations.dtype)
        fallbacks += failed
        if linears[key].prompt_copy != "none":  # it passed the self-check
            copy_bytes += len(same) * (shape.out_features * shape.in_features + 4 * shape.out_features
                                       if linears[key].prompt_copy == "int8" else
                                       prompt_weights.copy_bytes(shape.out_features, shape.in_features, activations.dtype))
    plan = KernelPlan(cpu=cpu, activations=activations, shapes=measured, linears=linears, source=source,
                      fallbacks=tuple(fallbacks), seconds=time.perf_counter() - started, deterministic=deterministic,
                      prompt_copy_bytes=copy_bytes)
    for line in fallbacks:
        log.warning("kernel self-check failed, falling back: %s", line)
    described = plan.describe()
    log.info("CPU %s; activations %s: %s", described["cpu"], described["activations"], described["activations_reason"])
    log.info("projection routes (%s, %.1f s): %s", source, plan.seconds, json.dumps(described["rows"]))
    return plan


def _measure(shape: ProjectionShape, *, dtype: torch.dtype, dot: ModuleType | None) -> ShapePlan:
    """`dot`: the int8-dot kernel where the shape fits it."""
    module = shape.synthetic(dtype=dtype, plan=LinearPlan(w8a8_from=None))
    int8_dot = isinstance(module, Int4Linear) and dot is not None and _dot_wins(module, dot)
    if int8_dot:  # the other routes race the weight-only kernel they will meet
        module = module.with_plan(replace(module.plan, int8_dot=dot))
    return measure_routes(module, head=shape.head, dtype=dtype, int8_dot=int8_dot)


def _dot_wins(module: Int4Linear, dot: ModuleType) -> bool:
    """The int8-dot kernel replaces torch's for every weight-only call (one kernel at every row count,
    so a stream's tokens do not depend on its batch) only where it wins by DOT_WINS' margins."""
    x = torch.randn(max(DOT_WINS), module.in_features, generator=torch.Generator().manual_seed(3)).to(KERNEL_DTYPE)
    with_dot = module.with_plan(replace(module.plan, int8_dot=dot))

    def native(rows: torch.Tensor) -> Callable[[], object]:
        return lambda: with_dot.weight_only(rows)

    def stock(rows: torch.Tensor) -> Callable[[], object]:
        return lambda: module.torch_weight_only(rows)

    with torch.inference_mode():
        return all(time_ms(native(x[:rows])) < most * time_ms(stock(x[:rows])) for rows, most in DOT_WINS.items())


def _gemm_ms(dtype: torch.dtype, *, rows: int, k: int, n: int) -> float:
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(rows, k, generator=gen).to(dtype), torch.randn(n, k, generator=gen).to(dtype)
    with torch.inference_mode():
        return time_ms(lambda: F.linear(x, w), repeats=3)


def _read_cache(path: Path) -> dict[str, ShapePlan] | None:
    return read_cached(path, lambda raw: {
        key: ShapePlan(w8a8_from=p["w8a8_from"], int8_dot=bool(p["int8_dot"]),
                       prompt_packed=bool(p["prompt_packed"]), prompt_int8=bool(p["prompt_int8"]),
                       timings_ms={path_: {int(r): float(ms) for r, ms in rungs.items()}
                                   for path_, rungs in p["timings_ms"].items()})
        for key, p in raw["shapes"].items()})


def _write_cache(path: Path, shapes: dict[str, ShapePlan]) -> None:
    write_cached(path, {"shapes": {key: asdict(p) for key, p in shapes.items()}})
