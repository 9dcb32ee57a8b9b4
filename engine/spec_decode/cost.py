"""What a verify step costs on this machine and model, measured once at start-up (the policy's curve).

For each batch size B of a small ladder, B decoding sequences over a short context run a step without
drafts and with k drafts each, for a few k. Each point is timed right after a one-sequence plain step,
and the curve is the median over rounds of the two's ratio, times the reference step's median: on a
machine that other work loads, a step's wall time stretches by whatever share of the cores it got, and
two steps back to back get about the same share. Run before any request: the sequences write their K/V
into the pool's first blocks, which are free then, as ModelRunner._warm_up does.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from decodeservice.engine.kv_cache import cdiv
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
    seconds: float  # what measuring took


def draft_ladder(num_tokens: int, batch_size: int) -> tuple[int, ...]:
    """Drafts per stream to time: at a few streams the small ones each (where kernels switch paths row by
    row) and the most; at many, one and two (the rest is the same slope: the step is compute-bound)."""
    wanted = (1, 2, 4, num_tokens) if batch_size <= 4 else (1, 2)
    return tuple(sorted({k for k in wanted if k <= num_tokens}))


def measure_step_costs(runner: ModelRunner, *, num_tokens: int, max_batch: int, num_blocks: int,
                       rounds: int = ROUNDS) -> MeasuredCost:
    """Step times by batch size (up to `max_batch`, and what `num_blocks` holds) and drafts per stream."""
    begun = time.perf_counter()
    # Shorter where the pool or the position table is small (tests' tiny engines).
    context = max(1, min(CONTEXT, num_blocks * runner.block_size - num_tokens - 1,
                         runner.model.rotary.max_positions - num_tokens - 1))
    per_seq = cdiv(context + num_tokens + 1, runner.block_size)
    largest = max(1, min(max_batch, num_blocks // per_seq))
    batches = tuple(sorted({b for b in BATCH_LADDER if b < largest} | {min(largest, BATCH_LADDER[-1])}))
    if len(batches) == 1:
        batches = (1, 2) if num_blocks // per_seq >= 2 else (1,)
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
