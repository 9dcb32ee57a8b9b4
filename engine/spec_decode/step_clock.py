"""What drafting steps took against what the plan predicted, per batch size, as the engine runs.

The start-up curve (cost.py) is a few medians taken before any request, on a machine whose load may
change: a row that cost 15% of a step then may cost 30% now, or other work may have made rows look free.
So the decoder times its own steps: the engine calls `propose` once a step, and the time from one call
to the next is that step's whole cycle (scheduling, the forward, sampling, settling the drafts). A step
is a sample only where it did nothing but decode: no sequence in prefill, none admitted since (a
prompt's rows would be in its time). Per batch size, plain steps give the step time without drafts, and
each drafting step's excess over it is set against the excess the plan predicted (the curve's rows plus
the measured overhead). `cost_scale(b)` is their ratio, which the plan multiplies its predicted extra
cost by: 1 until drafting steps were seen at that batch size, then mostly what they showed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Weight of the past per sample: a memory of about ten steps, so a change of load shows within a second.
CLOCK_DECAY = 0.9
# The prediction counts as this many drafting steps' worth of evidence that the scale is 1: one disturbed
# sample cannot swing the plan, three that agree move it most of the way.
PRIOR_STEPS = 2.0
# A cycle over this many times the batch size's plain step is the caller pausing between steps (a server
# waiting on its clients, a time slice lost to other work), not what the step's rows cost.
OUTLIER = 3.0
# The scale stays within these: beyond them a sample measures the machine's disturbance, not the rows.
SCALE_BOUNDS = (0.25, 4.0)


@dataclass(frozen=True, kw_only=True)
class StepSample:
    """One step's cycle: `batch_size` streams, `draft_rows` drafts verified among `drafting` streams."""

    batch_size: int
    draft_rows: int
    drafting: int
    ms: float


@dataclass(kw_only=True)
class _Open:
    started: float
    batch_size: int
    request_ids: frozenset[str]
    clean: bool  # nothing but decoding rows, as far as the decoder can tell at the step's start
    draft_rows: int = 0
    drafting: int = 0


@dataclass(kw_only=True)
class BatchTimes:
    """Decayed sums at one batch size (ms)."""

    plain_ms: float = 0.0  # the plain step's cycle, decayed mean
    plain_weight: float = 0.0
    observed_excess: float = 0.0  # drafting steps' cycle less plain_ms, decayed sum
    predicted_excess: float = 0.0  # what the plan predicted for the same steps, decayed sum
    drafting_steps: float = 0.0  # decayed count

    def scale(self) -> float:
        if self.drafting_steps <= 0 or self.predicted_excess <= 0:
            return 1.0
        mean = self.predicted_excess / self.drafting_steps
        ratio = (self.observed_excess + PRIOR_STEPS * mean) / (self.predicted_excess + PRIOR_STEPS * mean)
        return min(max(ratio, SCALE_BOUNDS[0]), SCALE_BOUNDS[1])


@dataclass(kw_only=True)
class StepClock:
    """Times the engine's steps from the decoder's calls; see the module docstring."""

    by_batch: dict[int, BatchTimes] = field(default_factory=dict)
    samples: int = 0
    _open: _Open | None = None

    def start_step(self, now: float, *, batch_size: int, request_ids: frozenset[str], clean: bool) -> StepSample | None:
        """A step starts (`propose`); returns the previous step's sample where it is one."""
        done, self._open = self._open, _Open(started=now, batch_size=batch_size, request_ids=request_ids, clean=clean)
        # A sequence in this step that was not in the last was admitted by it: its prompt ran there.
        if done is None or not done.clean or done.batch_size == 0 or not request_ids <= done.request_ids:
            return None
        return StepSample(batch_size=done.batch_size, draft_rows=done.draft_rows, drafting=done.drafting,
                          ms=(now - done.started) * 1000)

    def verified(self, draft_rows: int) -> None:
        """A stream of the open step verified `draft_rows` drafts (`settle`)."""
        if self._open is not None and draft_rows:
            self._open.draft_rows += draft_rows
            self._open.drafting += 1

    def record(self, sample: StepSample, *, predicted_excess_ms: float) -> None:
        """Fold in a sample; `predicted_excess_ms`: the plan's extra cost of its draft rows (0 if none)."""
        times = self.by_batch.setdefault(sample.batch_size, BatchTimes())
        if sample.draft_rows == 0:
            ms = sample.ms if times.plain_weight == 0 else min(sample.ms, OUTLIER * times.plain_ms)
            times.plain_weight = CLOCK_DECAY * times.plain_weight + 1.0
            times.plain_ms += (ms - times.plain_ms) / times.plain_weight
        elif times.plain_weight > 0 and predicted_excess_ms > 0:
            excess = min(max(sample.ms - times.plain_ms, -times.plain_ms), OUTLIER * times.plain_ms)
            times.observed_excess = CLOCK_DECAY * times.observed_excess + excess
            times.predicted_excess = CLOCK_DECAY * times.predicted_excess + predicted_excess_ms
            times.drafting_steps = CLOCK_DECAY * times.drafting_steps + 1.0
        self.samples += 1

    def cost_scale(self, batch_size: int) -> float:
        times = self.by_batch.get(batch_size)
        return times.scale() if times is not None else 1.0

    def describe(self) -> dict[str, dict[str, float]]:
        """Per batch size seen: the plain step's cycle (ms) and the scale."""
        return {str(b): {"plain_ms": round(t.plain_ms, 3), "cost_scale": round(t.scale(), 3),
                         "drafting_steps": round(t.drafting_steps, 1)}
                for b, t in sorted(self.by_batch.items())}
