"""What a verify step costs on this machine and model, measured once at start-up (the policy's curve).

For each batch size B of a small ladder, B decoding sequences over a short context run a step without
drafts and with k drafts each, for a few k. Each point is timed right after a one-sequence plain step,
and the curve is the median over rounds of the two's ratio, times the reference step's median: on a
machine that other work loads, a step's wall time stretches by whatever share of the cores it got, and
two steps back to back get about the same share. Run before any request: the sequences write their K/V
into the pool's first blocks, which are free then, as ModelRunner._warm_up does.

The curve is kept on disk beside the kernel plans (quant/kernel_plan.py's plan_cache_path: the kernel
cache, on the model cache's claim where the operator mounts one), keyed by the CPU (model, ISA caps,
threads), the GPU where there is one, torch, the activations' dtype and what the caller says shapes the
step (the model's shapes, the KV pool, the attention route, the executor), and the settings the
measurement itself depends on. So a restart reads it (the plan's source names the file) instead of
timing again; deleting that file, or pointing DECODESERVICE_KERNEL_CACHE at an empty folder as for the
kernel plans, measures afresh.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from decodeservice.engine.kv_cache import cdiv
from decodeservice.engine.plan.execution import MEASURED_NOW
from decodeservice.engine.quant.cpu import detect_cpu
from decodeservice.engine.quant.plan_cache import plan_cache_path, read_cached, write_cached
from decodeservice.engine.runner import ModelRunner
from decodeservice.engine.sampling_params import SamplingParams
from decodeservice.engine.scheduler import ScheduledSequence, SchedulerPlan
from decodeservice.engine.sequence import Sequence
from decodeservice.engine.spec_decode.policy import StepCostCurve

BATCH_LADDER = (1, 4, 16)  # beyond the last, linear (a batch that large is compute-bound already)
CONTEXT = 128  # tokens of each sequence before the step: a short chat turn
ROUNDS = 3  # medians of 3: one disturbed pair does not move a point


@dataclass(frozen=True, kw_only=True)
class MeasuredCost:
    curve: StepCostCurve
    row_cost: float  # one more draft row at one stream, as a fraction of its one-row step
    seconds: float  # what measuring took (this start's, or the cached measurement's)
    source: str = MEASURED_NOW  # or the cache file it was read from


def cached_step_costs(runner: ModelRunner, *, num_tokens: int, max_batch: int, num_blocks: int, identity: list[str],
                      cache_dir: Path | None = None) -> MeasuredCost:
    """measure_step_costs' result from the disk cache where this machine, model and setup measured it before,
    else measured now and kept. `identity`: what shapes the step's cost beyond the machine (see the module)."""
    context, batches = _ladder(runner, num_tokens=num_tokens, max_batch=max_batch, num_blocks=num_blocks)
    device = runner.device
    gpu = [f"gpu {torch.cuda.get_device_name(device)}"] if device.type == "cuda" else []
    keys = [*identity, *gpu, f"drafts {num_tokens}", f"context {context}", f"batches {list(batches)}",
            f"rounds {ROUNDS}", f"block {runner.block_size}"]
    path = plan_cache_path(cache_dir, detect_cpu(), runner.dtype, keys, prefix="spec-cost")
    cached = read_cached(path, lambda raw: _parse(raw, source=str(path)))
    if cached is not None:
        return cached
    cost = measure_step_costs(runner, num_tokens=num_tokens, max_batch=max_batch, num_blocks=num_blocks)
    write_cached(path, {"batch_sizes": cost.curve.batch_sizes, "extra_rows": cost.curve.extra_rows,
                        "step_ms": cost.curve.step_ms, "row_cost": cost.row_cost, "seconds": cost.seconds, "keys": keys})
    return cost


def _parse(raw: Any, *, source: str) -> MeasuredCost:
    curve = StepCostCurve(batch_sizes=tuple(int(b) for b in raw["batch_sizes"]),
                          extra_rows=tuple(tuple(int(n) for n in row) for row in raw["extra_rows"]),
                          step_ms=tuple(tuple(float(t) for t in row) for row in raw["step_ms"]))
    return MeasuredCost(curve=curve, row_cost=float(raw["row_cost"]), seconds=float(raw["seconds"]), source=source)


def _ladder(runner: ModelRunner, *, num_tokens: int, max_batch: int, num_blocks: int) -> tuple[int, tuple[int, ...]]:
    """The context each sequence holds and the batch sizes timed: shorter and fewer where the pool or the
    position table is small (tests' tiny engines)."""
    context = max(1, min(CONTEXT, num_blocks * runner.block_size - num_tokens - 1,
                         runner.model.rotary.max_positions - num_tokens - 1))
    per_seq = cdiv(context + num_tokens + 1, runner.block_size)
    largest = max(1, min(max_batch, num_blocks // per_seq))
    batches = tuple(sorted({b for b in BATCH_LADDER if b < largest} | {min(largest, BATCH_LADDER[-1])}))
    if len(batches) == 1:
        batches = (1, 2) if num_blocks // per_seq >= 2 else (1,)
    return context, batches


def draft_ladder(num_tokens: int, batch_size: int) -> tuple[int, ...]:
    """Drafts per stream to time: at a few streams the small ones each (where kernels switch paths row by
    row) and the most; at many, one and two (the rest is the same slope: the step is compute-bound)."""
    wanted = (1, 2, 4, num_tokens) if batch_size <= 4 else (1, 2)
    return tuple(sorted({k for k in wanted if k <= num_tokens}))


def measure_step_costs(runner: ModelRunner, *, num_tokens: int, max_batch: int, num_blocks: int,
                       rounds: int = ROUNDS) -> MeasuredCost:
    """Step times by batch size (up to `max_batch`, and what `num_blocks` holds) and drafts per stream."""
    begun = time.perf_counter()
    context, batches = _ladder(runner, num_tokens=num_tokens, max_batch=max_batch, num_blocks=num_blocks)
    per_seq = cdiv(context + num_tokens + 1, runner.block_size)
    seqs = []
    for i in range(max(batches)):
        seq = Sequence(request_id=f"verify-cost-{i}", prompt_token_ids=[0] * context,
                       params=SamplingParams(max_tokens=num_tokens + 1), block_ids=list(range(i * per_seq, (i + 1) * per_seq)))
        seq.num_computed_tokens = context - 1
        seqs.append(seq)

    def step_ms(batch: int, drafts: int) -> float:
        for seq in seqs[:batch]:
            seq.spec_token_ids = [0] * drafts  # any tokens: only the time is measured
        plan = SchedulerPlan(scheduled=[ScheduledSequence(seq=s, num_new_tokens=1 + drafts, num_spec_tokens=drafts)
                                        for s in seqs[:batch]])
        start = time.perf_counter()
        runner.execute(plan)
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
        return (time.perf_counter() - start) * 1000

    points = [(b, k) for b in batches for k in (0, *draft_ladder(num_tokens, b))]
    for b, k in points:
        step_ms(b, k)  # first calls pay for kernel selection and allocation
    refs: list[float] = []
    ratios: dict[tuple[int, int], list[float]] = {p: [] for p in points}
    for _ in range(rounds):
        for p in points:
            ref = step_ms(1, 0)
            refs.append(ref)
            ratios[p].append(step_ms(*p) / ref)
    unit = statistics.median(refs)
    best = {p: unit * statistics.median(r) for p, r in ratios.items()}
    if len(batches) == 1:  # a pool too small for two sequences: batch 2 as twice batch 1's step (compute-bound)
        batches = (1, 2)
        for k in (0, *draft_ladder(num_tokens, 1)):
            best[(2, k)] = 2 * best[(1, k)]
    ladders = {b: (0, *draft_ladder(num_tokens, b)) for b in batches}
    curve = StepCostCurve(
        batch_sizes=batches,
        extra_rows=tuple(tuple(b * k for k in ladders[b]) for b in batches),
        step_ms=tuple(tuple(best[(b, k)] for k in ladders[b]) for b in batches))
    plain, verify = best[(1, 0)], best[(1, num_tokens)]
    row_cost = min(max(verify - plain, 0.0) / (num_tokens * plain), 0.99)
    return MeasuredCost(curve=curve, row_cost=row_cost, seconds=time.perf_counter() - begun)
