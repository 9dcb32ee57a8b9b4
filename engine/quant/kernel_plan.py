"""This machine's kernels for a quantized model, chosen at load by capability and measurement.

    activations = choose_activations(detect_cpu(), hidden=576, intermediate=1536)   # bf16 or fp32
    plan = plan_kernels(shapes, activations=activations)  # shapes: the ProjectionShape of each module to build
    Int4Linear(weight, dtype=activations.dtype, plan=plan.linear(shape))   # the loader builds each so

Two choices, each made here for the CPU this runs on, never from constants measured on another box:
1. Activation (and KV cache) dtype: bf16 only where the CPU has native bf16 (cpu.py) AND a bf16 GEMM
   at the model's own prompt-chunk shape measures faster than fp32; else fp32, with the weight-only
   kernels still called with bf16 rows (their fp32 paths are scalar loops).
2. Per projection shape, from how many rows a call leaves the weight-only kernel for W8A8 (where on)
   or for a dense GEMM on dequantized weights: each path timed at a ladder of row counts on one module
   of that shape (min of a few runs), the threshold being the first rung from which the other path
   wins at every rung above.

Measurements are cached per CPU model, ISA caps, thread count, torch version and model shapes
(`$DECODESERVICE_KERNEL_CACHE`, else ~/.cache/decodeservice/kernels), so a restart does not pay again.
Every load, whatever the cache says, each shape's fast paths are compared with the dense reference (from
the project's own codes) on a spread of its output rows; a path that disagrees is turned off for that
shape and logged, and its modules are built on the next path. Timings and checks run on synthetic weights
of each shape (ProjectionShape.synthetic), before the model's quantized modules exist: a kernel's time
depends on the shape, not the values, and a misread layout or a wrong kernel shows on any weights. So
each module receives its finished plan at construction and nothing is set on it afterwards.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import torch
import torch.nn.functional as F

from decodeservice.engine.quant import prompt_weights
from decodeservice.engine.quant.cpu import CpuCapability, detect_cpu, int8_gemm_is_exact
from decodeservice.engine.quant.int4 import Int4Weight
from decodeservice.engine.quant.linear import (
    DENSE_MIN_ROWS,
    KERNEL_DTYPE,
    Int4Linear,
    Int8Linear,
    LinearPlan,
    RowPlanned,
    int8_dot_fits,
)
from decodeservice.engine.quant.native import dequant_extension, int4_dot_extension
from decodeservice.engine.quant.self_check import self_check

log = logging.getLogger("decodeservice.engine.kernels")
T = TypeVar("T")

DENSE_LADDER = (16, 32, 64, 128, 256, 512)  # prompt chunks reach max_num_batched_tokens (512 by default)
W8A8_LADDER = (2, 4, 6, 8, 12, 16, 32, 64)
HEAD_MAX_ROWS = 64  # the head only sees sampled rows: a decode batch and its drafts, not prompt chunks
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
# 3: dense thresholds as measured (the floor for mixed steps at the call); 4: native dequant; 5: int8 dot;
# 6: the int8-dot kernel on its own tiles (VNNI where the CPU has it); 7: it takes fp32 rows as they are;
# 8: prompt rows on a packed dense copy where faster (prompt_weights.py); 9: timings' min over 20 ms of runs
# (version 8's plans were measured with 5 runs: a loaded machine's cached one took torch's int4 kernel over the
# int8-dot kernel for q/k/v and gate/up); 10: prompt rows on an int8 copy where the CPU's int8 GEMM is exact
# and it beat the packed dense copy (prompt_weights.Int8Copy); 11: that int8 copy only under `--w8a8`
PLAN_VERSION = 11


@dataclass(frozen=True, kw_only=True)
class ActivationChoice:
    dtype: torch.dtype
    reason: str


@dataclass(frozen=True, kw_only=True)
class ShapePlan:
    """One projection shape's thresholds, with the timings (ms, per rung) that chose them."""

    dense_from: int | None  # as measured: for prompt-only steps (linear.StepRows)
    w8a8_from: int | None
    timings_ms: dict[str, dict[int, float]] = field(default_factory=dict)
    int8_dot: bool = False  # weight-only calls take native.py's int8-dot kernel, not torch's
    prompt_packed: bool = False  # prompt rows measured faster on a packed dense copy (prompt_weights.py)
    # prompt rows measured faster still on an int8 copy (prompt_weights.Int8Copy); it replaces the dense copy
    prompt_int8: bool = False

    @property
    def prompt_route(self) -> str:
        """Which copy prompt rows run on: "int8", "packed", or "as_planned" (none: the row thresholds' paths)."""
        return "int8" if self.prompt_int8 else "packed" if self.prompt_packed else "as_planned"

    @property
    def mixed_dense_from(self) -> int | None:
        """Where a step with decode or verify rows in it leaves the weight-only kernel."""
        return None if self.dense_from is None else max(self.dense_from, DENSE_MIN_ROWS)


@dataclass(frozen=True, kw_only=True)
class KernelPlan:
    cpu: CpuCapability
    activations: ActivationChoice
    shapes: dict[str, ShapePlan]  # as measured (or cached), by ProjectionShape.key
    linears: dict[str, LinearPlan]  # what each module of that shape is built with, self-checked
    source: str  # "measured" or the cache file it came from
    fallbacks: tuple[str, ...]  # "module: path turned off (error)" for each failed self-check
    native_dequant: bool  # the dense path dequantizes with native.py's C++ kernel (where it checked out)
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
            "native_dequant": self.native_dequant,
            # the routes each shape's modules were built with: measured, then self-checked
            "rows": {key: {"weight_only": "int8 dot (native)" if p.int8_dot is not None else "torch int4",
                           "dense_from_prompt_only": p.dense_from, "dense_from": p.mixed_dense_from,
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
    """Measure (or read from the cache) each projection shape's thresholds, then self-check each shape's
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
    # Before the measurement, so the dense path is timed with the dequantization it will run.
    native = dequant_extension() if any(s.int4 for s in shapes) else None
    dot = int4_dot_extension() if any(fits.values()) else None
    cache = plan_cache_path(cache_dir, cpu, activations.dtype, [*sorted(groups), f"native dequant {native is not None}",
                                                                f"int8 dot {dot is not None}"])
    measured = _read_cache(cache)
    source = str(cache) if measured is not None else "measured"
    if measured is None:
        measured = {key: _measure(same[0], dtype=activations.dtype, native=native, dot=dot if fits[key] else None)
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
        proposed = LinearPlan(dense_from=p.dense_from, w8a8_from=p.w8a8_from,
                              int8_dot=dot if p.int8_dot and fits[key] else None,
                              native_dequant=native if shape.int4 else None,
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
                      fallbacks=tuple(fallbacks), native_dequant=native is not None and not any(
                          s.int4 and linears[s.key].native_dequant is None for s in shapes),
                      seconds=time.perf_counter() - started, deterministic=deterministic, prompt_copy_bytes=copy_bytes)
    for line in fallbacks:
        log.warning("kernel self-check failed, falling back: %s", line)
    described = plan.describe()
    log.info("CPU %s; activations %s: %s", described["cpu"], described["activations"], described["activations_reason"])
    log.info("row thresholds (%s, %.1f s): %s", source, plan.seconds, json.dumps(described["rows"]))
    return plan


def _measure(shape: ProjectionShape, *, dtype: torch.dtype, native: ModuleType | None,
             dot: ModuleType | None) -> ShapePlan:
    """`dot`: the int8-dot kernel where the shape fits it."""
    module = shape.synthetic(dtype=dtype, plan=LinearPlan(dense_from=None, w8a8_from=None,
                                                          native_dequant=native if shape.int4 else None))
    int8_dot = isinstance(module, Int4Linear) and dot is not None and _dot_wins(module, dot)
    if int8_dot:  # the dense path races the weight-only kernel it will meet
        module = module.with_plan(replace(module.plan, int8_dot=dot))

    def weight_only(x: torch.Tensor) -> Callable[[], object]:
        return lambda: module.weight_only_rows(x)

    def dense(x: torch.Tensor) -> Callable[[], object]:
        return lambda: F.linear(x, module.dense_weight(dtype))  # the dequantization is part of the path

    def w8a8(x: torch.Tensor) -> Callable[[], object]:
        return lambda: module.w8a8(x)

    x = torch.randn(max(DENSE_LADDER), module.in_features, generator=torch.Generator().manual_seed(1)).to(dtype)
    timings: dict[str, dict[int, float]] = {}
    with torch.inference_mode():
        ladder = tuple(r for r in DENSE_LADDER if not shape.head or r <= HEAD_MAX_ROWS)
        timings["weight_only"], timings["dense"] = _race(weight_only, dense, x, ladder)
        w8a8_from = None
        if module.has_w8a8:
            timings["weight_only_small"], timings["w8a8"] = _race(weight_only, w8a8, x, W8A8_LADDER)
            w8a8_from = first_win(timings["w8a8"], timings["weight_only_small"])
    dense_from = first_win(timings["dense"], timings["weight_only"])
    prompt_packed = prompt_int8 = False
    if not shape.head:
        planned = module.with_plan(replace(module.plan, dense_from=dense_from, w8a8_from=w8a8_from))
        best: Callable[[torch.Tensor], torch.Tensor] = planned.prompt_path  # the prompt path as planned
        if prompt_weights.supported(dtype):
            weight = module.dense_weight(dtype)
            prompt_packed, packed_timings = prompt_weights.race(planned.prompt_path, weight, x, time_ms=_time_ms)
            timings.update({f"prompt_{path}": rungs for path, rungs in packed_timings.items()})
            if prompt_packed:
                best = prompt_weights.packed_linear(weight)
        # int8 prompt rows quantize the activations, which `--w8a8` opts into: against the bf16 copies
        # they moved the first token's top-5 logprobs by 0.25-0.87 nat (greedy text alike), a
        # quality change the default does not make for speed (benchmarks/prefill_breakdown.py times it).
        # Only where the int8 GEMM is exact: else _int_mm may saturate (no VNNI / AMX-INT8 in use).
        if module.has_w8a8 and int8_gemm_is_exact():
            copy = prompt_weights.Int8Copy.of(module.dense_weight(torch.float32))
            prompt_int8, int8_timings = prompt_weights.race_int8(best, copy, x, time_ms=_time_ms)
            timings.update({f"prompt_int8_{path}": rungs for path, rungs in int8_timings.items()})
    return ShapePlan(dense_from=dense_from, w8a8_from=w8a8_from, timings_ms=timings, int8_dot=int8_dot,
                     prompt_packed=prompt_packed, prompt_int8=prompt_int8)


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
        return all(_time_ms(native(x[:rows])) < most * _time_ms(stock(x[:rows])) for rows, most in DOT_WINS.items())


def _race(incumbent: Callable[[torch.Tensor], Callable[[], object]],
          challenger: Callable[[torch.Tensor], Callable[[], object]], x: torch.Tensor,
          ladder: tuple[int, ...]) -> tuple[dict[int, float], dict[int, float]]:
    """Both paths timed up the ladder, stopping once the challenger has won two rungs running: the
    weight-only kernel's cost grows linearly with rows (it dequantizes per block of rows), the others'
    by less, so a lead taken is kept. This keeps the most expensive rungs out of the start-up."""
    times: tuple[dict[int, float], dict[int, float]] = ({}, {})
    wins = 0
    for rows in ladder:
        times[0][rows], times[1][rows] = _time_ms(incumbent(x[:rows])), _time_ms(challenger(x[:rows]))
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


def _time_ms(fn: Callable[[], object], *, repeats: int = 5, budget_s: float = 0.02, most: int = 200) -> float:
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


def _gemm_ms(dtype: torch.dtype, *, rows: int, k: int, n: int) -> float:
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(rows, k, generator=gen).to(dtype), torch.randn(n, k, generator=gen).to(dtype)
    with torch.inference_mode():
        return _time_ms(lambda: F.linear(x, w), repeats=3)


def plan_cache_path(cache_dir: Path | None, cpu: CpuCapability, dtype: torch.dtype, keys: list[str], *,
                    prefix: str = "plan") -> Path:
    identity = {"version": PLAN_VERSION, "cpu": cpu.model_name, "aten": cpu.aten, "onednn": cpu.onednn_max_isa,
                "mkl": cpu.mkl_instructions, "flags": sorted(cpu.flags), "threads": torch.get_num_threads(),
                "torch": torch.__version__, "activations": str(dtype), "shapes": keys}
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:20]
    root = cache_dir or Path(os.environ.get("DECODESERVICE_KERNEL_CACHE") or
                             Path.home() / ".cache" / "decodeservice" / "kernels")
    return root / f"{prefix}-{digest}.json"


def _read_cache(path: Path) -> dict[str, ShapePlan] | None:
    return read_cached(path, lambda raw: {
        key: ShapePlan(dense_from=p["dense_from"], w8a8_from=p["w8a8_from"], int8_dot=bool(p["int8_dot"]),
                       prompt_packed=bool(p["prompt_packed"]), prompt_int8=bool(p["prompt_int8"]),
                       timings_ms={path_: {int(r): float(ms) for r, ms in rungs.items()}
                                   for path_, rungs in p["timings_ms"].items()})
        for key, p in raw["shapes"].items()})


def read_cached(path: Path, parse: Callable[[Any], T]) -> T | None:
    """`parse` of the JSON at `path`; None where there is none yet, or where it is torn or from an older
    layout (logged): then the caller measures again."""
    try:
        return parse(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("ignoring cached kernel choice %s: %s", path, exc)
        return None


def _write_cache(path: Path, shapes: dict[str, ShapePlan]) -> None:
    write_cached(path, {"shapes": {key: asdict(p) for key, p in shapes.items()}})


def write_cached(path: Path, value: dict[str, Any]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(value, indent=1))
        tmp.replace(path)  # atomic: pods sharing a cache volume never read half a file
    except OSError as exc:  # a read-only home in a pod: the choice still applies, it is just not kept
        log.warning("could not cache the kernel choice at %s: %s", path, exc)
