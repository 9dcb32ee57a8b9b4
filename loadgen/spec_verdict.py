"""The demo's verdict on speculation: per-round ratios, their spread, and why speculation did what it did.

Pure functions over what the demo measured: the summaries of each round (off and on sent the same
requests, one after the other), the speculation counters of the engine with speculation on, and what
that engine measured at start-up (its /v1/models card: from what acceptance a draft pays per batch size).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from decodeservice.loadgen.metrics import LevelSummary, RequestRecord, Slo, summarize

# A median ratio within this of 1.0 reads as "the same": the demo's rounds are short, and a shared
# laptop's other work moves a round by a few percent.
SAME_BAND = 0.03


@dataclass(frozen=True, kw_only=True)
class Comparison:
    """Speculation on against off: output tokens/s, on / off, in each round."""

    ratios: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.ratios)

    @property
    def spread(self) -> str:
        return f"{min(self.ratios):.2f}-{max(self.ratios):.2f}"

    @property
    def verdict(self) -> str:
        """Faster, slower or the same, by the median round; the spread says how sure."""
        median, low, high = self.median, min(self.ratios), max(self.ratios)
        if median > 1 + SAME_BAND:
            word = "faster"
        elif median < 1 - SAME_BAND:
            word = "slower"
        else:
            word = f"the same within {SAME_BAND:.0%}"
        sure = ("every round agrees" if low > 1 or high < 1 else "rounds on both sides of 1.0: within this "
                "machine's noise")
        return (f"speculation on is {word}: output tok/s x{median:.2f} (median of {len(self.ratios)} rounds, "
                f"{self.spread}; {sure})")


@dataclass(frozen=True, kw_only=True)
class SpecActivity:
    """What the engine with speculation on did: its counters over the runs, and its start-up measurement."""

    drafts: float  # verifications
    draft_tokens: float
    accepted_tokens: float
    output_tokens: int
    concurrency: int
    disable_batch_size: int | None = None
    break_even: Mapping[int, float] = dataclasses.field(default_factory=dict)  # batch size -> acceptance

    @property
    def acceptance(self) -> float | None:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    @property
    def speculated_share(self) -> float:
        """Share of the output that came out of verification steps (drafts accepted, plus their own token)."""
        return (self.drafts + self.accepted_tokens) / self.output_tokens if self.output_tokens else 0.0

    def break_even_at(self, batch_size: int) -> float | None:
        """The acceptance a draft needs at `batch_size` streams: the measured batch size at or below it."""
        sizes = [b for b in sorted(self.break_even) if b <= batch_size]
        return self.break_even[sizes[-1]] if sizes else None

    def reason(self) -> str:
        """Why speculation drafted as much (or as little) as it did, in one sentence."""
        c = self.concurrency
        if self.disable_batch_size is not None and c >= self.disable_batch_size:
            return f"speculation is off at {c} streams: the engine turns it off from {self.disable_batch_size}"
        need = self.break_even_at(c)
        rate = self.acceptance
        share = f"{self.speculated_share:.0%} of the output came from verified drafts"
        if need is not None and need >= 1.0:
            return (f"at {c} streams this machine's step is compute-bound (a draft would have to land more than "
                    f"always to pay), so speculation stays off; {share}")
        if rate is None:
            return ("no request drafted: the drafts found nothing to propose, or none was expected to pay (a "
                    "request drafts once its own checked drafts, shadow drafts included, say it pays)")
        needs = (f"; a draft pays here from {need:.0%} at {c} streams (measured at start-up, corrected by what the "
                 f"engine's steps took, while requests wait for a slot; with none waiting, only where it shortens the "
                 f"batch)") if need is not None else ""
        return f"drafts landed {rate:.0%}{needs}: speculation drafted where it paid and backed off elsewhere; {share}"


def pooled(label: str, rounds: Sequence[LevelSummary], records: Sequence[RequestRecord], *, slo: Slo | None
           ) -> LevelSummary:
    """All rounds of one mode as one summary: latencies over every request, throughput over the rounds'
    own wall time (the other mode's rounds ran in between)."""
    summary = summarize(records, label=label, slo=slo)
    duration = sum(r.duration_s for r in rounds)
    if duration <= 0:
        return summary
    good = summary.goodput_fraction
    return dataclasses.replace(summary, duration_s=duration, request_throughput=summary.completed / duration,
                               output_throughput=summary.total_output_tokens / duration,
                               goodput_rps=None if good is None else good * summary.num_requests / duration)
