"""How many drafts each decoding stream verifies in a step: pure functions over measured step times.

A step of B decoding streams that verifies n draft rows in all takes T(B, n) ms (`StepCostCurve`,
measured at start-up by cost.py) and yields B tokens plus the accepted drafts. Draft j of a stream
whose drafts land with probability a each (given the ones before it landed) is accepted with
probability a**j. The plan takes the candidate rows in order of a**j and keeps the prefix that
maximises expected tokens per millisecond,

    (B + sum of the kept a**j) / (T(B, n) + overhead_ms x streams drafting),

and drafts nothing unless that beats plain decoding, B / T(B, 0), by `min_gain`. So one rule backs
off per request (a low a puts its rows last) and per batch (T's slope in n is the batch's own: at
16 streams the step is compute-bound and an extra row costs nearly its full share, where at one
stream it costs a small fraction of the step). `overhead_ms` is what drafting costs outside the
forward per stream (the proposer, the verification), which the decoder measures as it runs.

What the plan is handed is measured, and shrunk where the measurement is thin:
- a stream's acceptance is the mean of a Beta posterior over its own verifications (and, for a proposer
  that costs nothing to ask, its unverified "shadow" drafts checked against the tokens that came), under
  a prior whose mean is the engine's recent acceptance pulled toward PESSIMISTIC_ACCEPTANCE and whose
  weight is a few verifications (`request_prior`): a new request drafts little until its own evidence
  says more, so a workload whose drafts seldom land does not open every request with long losing drafts;
- the extra cost of draft rows is the start-up curve's, times what steps took against what it predicted
  at this batch size (`cost_scale`, from step_clock.py);
- a request whose verifications gained less than they cost (`realized_gain` below 1) stops drafting and
  goes back to being watched (hysteresis: it needs 1 + min_gain expected to start again).
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# Speculation must beat plain decoding by this much in expectation before a step drafts at all: the
# acceptance and step-time estimates are noisy, and a predicted 2% gain is as likely a loss.
MIN_GAIN = 0.05
# No draft row is free: each costs at least this share of a one-stream plain step (the head and the
# row's attention alone; quiet machines measured 0.04-0.3 per row). A start-up measurement that other
# work disturbed can show rows costing nothing, and the plan then drafted 8 rows for drafts landing 5%.
MIN_ROW_COST = 0.03


@dataclass(frozen=True, kw_only=True)
class StepCostCurve:
    """Decode step time in ms by batch size and draft rows: at `batch_sizes[i]` streams, verifying
    `extra_rows[i][j]` drafts in all took `step_ms[i][j]`. Linear between the measured points and,
    along each axis, beyond them (from the last two)."""

    batch_sizes: tuple[int, ...]  # ascending, at least two
    extra_rows: tuple[tuple[int, ...], ...]  # per batch size: ascending from 0, at least two
    step_ms: tuple[tuple[float, ...], ...]

    def __post_init__(self) -> None:
        if len(self.batch_sizes) < 2 or list(self.batch_sizes) != sorted(set(self.batch_sizes)) or self.batch_sizes[0] < 1:
            raise ValueError(f"batch_sizes must be >= 2 distinct ascending sizes from 1 up, not {self.batch_sizes}")
        if not len(self.extra_rows) == len(self.step_ms) == len(self.batch_sizes):
            raise ValueError("need one row of extra_rows and step_ms per batch size")
        for rows, times in zip(self.extra_rows, self.step_ms, strict=True):
            if len(rows) < 2 or rows[0] != 0 or list(rows) != sorted(set(rows)) or len(times) != len(rows):
                raise ValueError(f"each extra_rows row must ascend from 0 with a time per entry, not {rows}")
            if not all(t > 0 for t in times):
                raise ValueError("step times must be positive")

    @classmethod
    def linear(cls, row_cost: float) -> StepCostCurve:
        """Every row, a stream's or a draft's, costs `row_cost` of a one-row step (a configured
        `draft_row_cost`): T(B, n) = 1 + row_cost x (B - 1 + n)."""
        c = row_cost
        return cls(batch_sizes=(1, 2), extra_rows=((0, 1), (0, 1)), step_ms=((1.0, 1.0 + c), (1.0 + c, 1.0 + 2 * c)))

    def row_ms(self, batch_size: int, max_extra: int) -> np.ndarray:
        """T(batch_size, n) for n = 0 .. max_extra, floored at T(batch_size, 0). (max_extra + 1,), read-only"""
        return _row_ms(self, batch_size, max_extra)

    def _row_ms(self, batch_size: int, max_extra: int) -> np.ndarray:
        n = np.arange(max_extra + 1, dtype=np.float64)
        i = min(max(bisect.bisect_right(self.batch_sizes, batch_size) - 1, 0), len(self.batch_sizes) - 2)
        lo, hi = self.batch_sizes[i], self.batch_sizes[i + 1]
        at_lo, at_hi = self._along_rows(i, n), self._along_rows(i + 1, n)
        times = at_lo + (at_hi - at_lo) * (batch_size - lo) / (hi - lo)
        floor = max(float(times[0]), 1e-9)
        floored: np.ndarray = np.maximum(times, floor)
        floored.setflags(write=False)
        return floored

    def _along_rows(self, i: int, n: np.ndarray) -> np.ndarray:
        rows = np.asarray(self.extra_rows[i], dtype=np.float64)
        times = np.asarray(self.step_ms[i], dtype=np.float64)
        out: np.ndarray = np.interp(n, rows, times)
        beyond = n > rows[-1]
        if beyond.any():
            slope = (times[-1] - times[-2]) / (rows[-1] - rows[-2])
            out[beyond] = times[-1] + slope * (n[beyond] - rows[-1])
        return out

    def describe(self) -> str:
        """Each batch size's cost of its measured draft rows, relative to its plain step."""
        parts = []
        for b, rows, times in zip(self.batch_sizes, self.extra_rows, self.step_ms, strict=True):
            rel = " ".join(f"+{n}:{t / times[0]:.2f}" for n, t in zip(rows[1:], times[1:], strict=True))
            parts.append(f"B={b} {times[0]:.1f} ms ({rel})")
        return "; ".join(parts)


@dataclass(frozen=True, kw_only=True)
class DraftPlan:
    """Drafts per stream for one step, and the rate the plan expects against plain decoding."""

    draft_lengths: tuple[int, ...]
    expected_speedup: float  # expected tokens per ms with these drafts over without (1.0: none)


def plan_drafts(acceptances: Sequence[float], max_drafts: Sequence[int], *, curve: StepCostCurve,
                overhead_ms: float = 0.0, min_gain: float = MIN_GAIN, cost_scale: float = 1.0,
                token_values: Sequence[float] | None = None) -> DraftPlan:
    """The draft length per stream that maximises expected tokens per ms in a step of these streams.

    acceptances[i]: stream i's chance that each draft lands given the ones before it did; max_drafts[i]:
    the most it may draft (0: it cannot draft this step, but still decodes); cost_scale: what drafting
    steps took over what the curve and overhead predicted at this batch size (1: as predicted);
    token_values[i]: what an accepted draft of stream i is worth against a token of plain decoding (1 if
    not given; `tail_values` when no request waits)."""
    batch = len(acceptances)
    if batch == 0:
        return DraftPlan(draft_lengths=(), expected_speedup=1.0)
    owner = np.repeat(np.arange(batch), [max(m, 0) for m in max_drafts])
    if owner.size == 0:
        return DraftPlan(draft_lengths=(0,) * batch, expected_speedup=1.0)
    # position j (1-based) of each stream's candidates, stream-major: the stable sort below keeps a
    # stream's rows in order among equal gains (acceptance 1).
    starts = np.concatenate(([0], np.cumsum([max(m, 0) for m in max_drafts])[:-1]))
    position = np.arange(owner.size) - starts[owner] + 1
    values = np.ones(batch) if token_values is None else np.asarray(token_values, dtype=np.float64)
    gain: np.ndarray = values[owner] * np.asarray(acceptances, dtype=np.float64).clip(0.0, 1.0)[owner] ** position
    order = np.argsort(-gain, kind="stable")
    tokens = batch + np.cumsum(gain[order])  # (n,) expected tokens with the first n candidates
    streams = np.cumsum(position[order] == 1)  # streams drafting among them
    times = _floored(curve, batch, owner.size)
    plain_rate = batch / times[0]
    rates = tokens / (times[0] + cost_scale * (times[1:] - times[0] + overhead_ms * streams))
    best = int(np.argmax(rates))
    speedup = float(rates[best] / plain_rate)
    if speedup < 1.0 + min_gain:
        return DraftPlan(draft_lengths=(0,) * batch, expected_speedup=1.0)
    lengths = np.bincount(owner[order[: best + 1]], minlength=batch)
    return DraftPlan(draft_lengths=tuple(int(k) for k in lengths), expected_speedup=speedup)


@dataclass(frozen=True, kw_only=True)
class TailValues:
    """The plan's inputs for a batch that nothing waits to join: acceptances and token values per stream."""

    acceptances: tuple[float, ...]
    token_values: tuple[float, ...]


def tail_values(acceptances: Sequence[float], remaining: Sequence[int], can_draft: Sequence[bool], *,
                curve: StepCostCurve) -> TailValues:
    """What accepted drafts are worth when no request waits for a slot: the batch's wall time is then its
    longest stream's, and a stream that finishes sooner frees a slot nobody takes.

    A stream behind the longest (fewer tokens `remaining`) that gains a token leaves the batch a step
    sooner: that saves the others its row in each later step, T(B) - T(B-1), not its share T(B) / B of
    the step (at 4 streams on a CPU a row is a fifth of the share or less), so its drafts are worth that
    ratio of a token. The longest streams (all of them, where the requests came together) end the batch
    sooner only if every one of them gains: their drafts are worth a full token, at the least acceptance
    among them, where all of them may draft; where one of them cannot, none of theirs shortens the batch
    and they count as the others do. One stream: its own wall time, unchanged."""
    batch = len(acceptances)
    if batch <= 1:
        return TailValues(acceptances=tuple(acceptances), token_values=(1.0,) * batch)
    plain = float(curve.row_ms(batch, 0)[0])
    row = max(plain - float(curve.row_ms(batch - 1, 0)[0]), 0.0)
    behind = min(row * batch / plain, 1.0)
    longest = max(remaining)
    critical = [r >= longest for r in remaining]
    values = [behind] * batch
    out = list(acceptances)
    if all(ok for ok, c in zip(can_draft, critical, strict=True) if c):
        least = min(a for a, c in zip(acceptances, critical, strict=True) if c)
        for i, c in enumerate(critical):
            if c:
                values[i], out[i] = 1.0, least
    return TailValues(acceptances=tuple(out), token_values=tuple(values))


def least_paying_acceptance(batch_size: int, *, curve: StepCostCurve, overhead_ms: float = 0.0,
                            min_gain: float = MIN_GAIN, cost_scale: float = 1.0) -> float:
    """The acceptance from which one draft of one stream pays in a step of `batch_size` streams (may
    exceed 1: then nothing drafts at this batch size, and probing a paused request cannot pay either)."""
    plain, one = _floored(curve, batch_size, 1)
    cost = plain + cost_scale * (one - plain + overhead_ms)
    return float((1.0 + min_gain) * batch_size * cost / plain - batch_size)


def keep_and_start_acceptances(batch_size: int, *, curve: StepCostCurve, overhead_ms: float = 0.0,
                               cost_scale: float = 1.0, min_gain: float = MIN_GAIN) -> tuple[float, float]:
    """least_paying_acceptance at no margin (a drafting request goes on from it) and at `min_gain` (a
    watched one starts from it), from one look at the curve: the decoder asks every step."""
    plain, one = _floored(curve, batch_size, 1)
    ratio = batch_size * (plain + cost_scale * (one - plain + overhead_ms)) / plain
    return float(ratio - batch_size), float((1.0 + min_gain) * ratio - batch_size)


# A request's acceptance before its own evidence: the engine's recent acceptance, pulled toward this. A
# draft that lands 10% of the time pays nowhere on the curves measured here (one row costs 4-30% of a
# one-stream step), so a request starting from it drafts only once its own evidence lifts it.
PESSIMISTIC_ACCEPTANCE = 0.1
# Weights, in drafts checked: the engine's recent acceptance counts as at most WORKLOAD_WEIGHT drafts
# against PESSIMISM_WEIGHT at the pessimistic value (a workload whose drafts land 90% of the time starts
# its requests at 0.63, one whose drafts land 20% at 0.17), and the prior as PRIOR_WEIGHT drafts of the
# request's own, so two or three checked drafts of its own outweigh it.
WORKLOAD_WEIGHT = 4.0
PESSIMISM_WEIGHT = 2.0
PRIOR_WEIGHT = 2.0


@dataclass(frozen=True, kw_only=True)
class BetaPrior:
    """Pseudo-counts of landed drafts (`hits`) and rejections (`misses`)."""

    hits: float
    misses: float

    @property
    def mean(self) -> float:
        return self.hits / (self.hits + self.misses)


def request_prior(workload_acceptance: float, workload_evidence: float) -> BetaPrior:
    """A new request's prior: the engine's recent acceptance (over `workload_evidence` checked drafts,
    decayed) shrunk toward PESSIMISTIC_ACCEPTANCE, with the weight of PRIOR_WEIGHT checked drafts."""
    weight = min(max(workload_evidence, 0.0), WORKLOAD_WEIGHT)
    mean = (weight * workload_acceptance + PESSIMISM_WEIGHT * PESSIMISTIC_ACCEPTANCE) / (weight + PESSIMISM_WEIGHT)
    return BetaPrior(hits=PRIOR_WEIGHT * mean, misses=PRIOR_WEIGHT * (1.0 - mean))


def posterior_acceptance(hits: float, misses: float, prior: BetaPrior) -> float:
    """The mean of the Beta posterior: each draft lands with this chance given the ones before it did."""
    return (prior.hits + hits) / (prior.hits + prior.misses + hits + misses)


def verify_cost_units(batch_size: int, drafts: int, *, curve: StepCostCurve, overhead_ms: float = 0.0,
                      cost_scale: float = 1.0) -> float:
    """What one stream verifying `drafts` costs, in units of its share of a plain step of `batch_size`
    streams (1.0: no drafts). Its tokens over this, summed over verifications, is its realized gain."""
    times = _floored(curve, batch_size, drafts)
    extra = cost_scale * (float(times[drafts] - times[0]) + (overhead_ms if drafts else 0.0))
    return 1.0 + extra * batch_size / float(times[0])


def realized_gain(tokens: float, cost_units: float) -> float:
    """Tokens per unit of a plain step's share, over a request's verifications (1.0: no evidence)."""
    return tokens / cost_units if cost_units > 0 else 1.0


# The plan asks the curve the same few questions every step (one batch size, up to its rows): answered
# once each. A curve is frozen and hashable, so the answers are keyed by it and cannot go stale.
@functools.lru_cache(maxsize=1024)
def _row_ms(curve: StepCostCurve, batch_size: int, max_extra: int) -> np.ndarray:
    return curve._row_ms(batch_size, max_extra)


@functools.lru_cache(maxsize=1024)
def _floored(curve: StepCostCurve, batch_size: int, max_extra: int) -> np.ndarray:
    """The curve's T(batch_size, n), each extra row at least MIN_ROW_COST of the one-stream plain step.
    Read-only: it is shared between calls."""
    times = curve.row_ms(batch_size, max_extra)
    least: np.ndarray = times[0] + MIN_ROW_COST * float(curve.row_ms(1, 0)[0]) * np.arange(max_extra + 1)
    floored: np.ndarray = np.maximum(times, least)
    floored.setflags(write=False)
    return floored


def draft_rows_ms(batch_size: int, draft_rows: int, drafting: int, *, curve: StepCostCurve,
                  overhead_ms: float = 0.0) -> float:
    """What the plan predicts `draft_rows` drafts among `drafting` streams add to a step of `batch_size`
    streams (ms, before any cost_scale): the curve's rows and the overhead outside the forward."""
    times = _floored(curve, batch_size, draft_rows)
    return float(times[draft_rows] - times[0]) + overhead_ms * drafting
