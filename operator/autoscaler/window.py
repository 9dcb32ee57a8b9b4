"""Per-pod sample history and windowed values from cumulative-histogram deltas.

Each pod's proxy exposes cumulative histograms (counts since the proxy started). What happened in the
last W seconds is the increase of every bucket over the samples inside the window, summed over pods.
The increase follows Prometheus' `increase()` without its extrapolation: consecutive samples are
differenced, and when a count goes down the pod restarted (a counter reset), so the later sample's
counts are the increase since the restart. A reset is decided for the whole histogram at once (a
restarted proxy resets every series together), which keeps the buckets of one delta consistent.

Percentiles and attainment interpolate linearly inside the bucket that holds the rank (or the threshold),
as Prometheus' `histogram_quantile` does; the +Inf bucket is never interpolated into.

A sample that cannot be true (NaN, inf, negative, decreasing buckets, mismatched lengths, counts no proxy
can reach) is rejected whole by `FleetHistory.add`, which tells the caller so it can count the pod as
failed. Samples older than the horizon (the longest window) are dropped and pods not seen for that long
are forgotten.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from decodeservice.operator.autoscaler.types import Histogram, PodSample

Metric = Literal["ttft", "itl"]

# 2**53: beyond it float counts stop being exact integers; no proxy lives long enough to get there.
MAX_COUNT = float(2**53)
# A pod's gauges (in flight, queued, engine waiting) above this are a lie or a bug, not load.
MAX_GAUGE = 1e6


@dataclass(frozen=True, kw_only=True)
class WindowedHistogram:
    """Observations inside a window, as cumulative counts per upper bound (the last bound is +inf)."""

    bounds: tuple[float, ...]
    counts: tuple[float, ...]

    @property
    def total(self) -> float:
        return self.counts[-1] if self.counts else 0.0

    def quantile(self, q: float) -> float | None:
        """The q-quantile (0..1), as `histogram_quantile` computes it; None when the window is empty.

        The rank q * total falls in one bucket; the value is interpolated linearly between that bucket's
        lower bound (0 for the first) and its upper bound. A rank in the +Inf bucket gives the highest
        finite bound, the most the histogram can say.
        """
        total = self.total
        if total <= 0.0:
            return None
        rank = min(max(q, 0.0), 1.0) * total
        below = 0.0
        for i, (upper, cum) in enumerate(zip(self.bounds, self.counts, strict=True)):
            if cum >= rank and cum > below:
                if math.isinf(upper):
                    return self.bounds[i - 1] if i > 0 else None
                lower = self.bounds[i - 1] if i > 0 else 0.0
                return lower + (upper - lower) * (rank - below) / (cum - below)
            below = cum
        return self.bounds[-2] if len(self.bounds) > 1 else None

    def share_at_most(self, threshold: float) -> float | None:
        """Share of observations <= threshold, interpolated inside its bucket; None when empty."""
        total = self.total
        if total <= 0.0:
            return None
        below = 0.0
        lower = 0.0
        for upper, cum in zip(self.bounds, self.counts, strict=True):
            if threshold <= upper:
                if math.isinf(upper):
                    return below / total  # above the highest finite bound: nothing more is known
                span = upper - lower
                frac = 1.0 if span <= 0.0 else max(threshold - lower, 0.0) / span
                return (below + (cum - below) * frac) / total
            below, lower = cum, upper
        return 1.0


def valid_histogram(h: Histogram | None) -> bool:
    """True when h can be a real scrape: ascending bounds ending at +inf, finite non-decreasing counts."""
    if h is None:
        return True
    b, c = h.bounds, h.counts
    if len(b) < 1 or len(b) != len(c) or not math.isinf(b[-1]) or b[-1] < 0:
        return False
    if any(not math.isfinite(x) or x < 0.0 for x in b[:-1]):
        return False
    if any(b[i] >= b[i + 1] for i in range(len(b) - 1)):
        return False
    if any(not math.isfinite(x) or x < 0.0 or x > MAX_COUNT for x in c):
        return False
    if any(c[i] > c[i + 1] for i in range(len(c) - 1)):
        return False
    return math.isfinite(h.total) and 0.0 <= h.total <= MAX_COUNT


def _valid_gauge(x: float | None, *, top: float = MAX_GAUGE) -> bool:
    return x is None or (isinstance(x, int | float) and math.isfinite(x) and 0.0 <= x <= top)


def valid_sample(s: PodSample) -> bool:
    """True when every number in the sample is one a real proxy could report."""
    if not isinstance(s.at, int | float) or not math.isfinite(s.at):
        return False
    if not (_valid_gauge(s.inflight) and _valid_gauge(s.engine_waiting) and _valid_gauge(s.engine_running)):
        return False
    if not _valid_gauge(s.kv_cache_usage, top=1.0):
        return False
    for m in s.classes.values():
        if not (_valid_gauge(m.queue_depth) and valid_histogram(m.ttft) and valid_histogram(m.itl)):
            return False
    return True


def _delta(prev: Histogram, cur: Histogram, seconds: float,
           max_rate: float) -> tuple[float, ...] | None:
    """Bucket increases from prev to cur; a reset counts cur whole; None when not comparable."""
    if prev.bounds != cur.bounds:
        return None  # the proxy was replaced by one with other buckets: no common ground
    if any(c < p for p, c in zip(prev.counts, cur.counts, strict=True)):
        inc = cur.counts  # counter reset: the pod restarted, everything since is new
    else:
        inc = tuple(c - p for p, c in zip(prev.counts, cur.counts, strict=True))
    if inc[-1] > max_rate * max(seconds, 1.0):
        return None  # more observations than any proxy can make in that time
    return inc


class FleetHistory:
    """Recent samples per pod, and the windowed histograms and gauges summed over the fleet."""

    def __init__(self, *, horizon_seconds: float, max_observations_per_second: float = 1e6) -> None:
        if not horizon_seconds > 0:
            raise ValueError(f"horizon_seconds must be > 0, got {horizon_seconds}")
        self.horizon = horizon_seconds
        self.max_rate = max_observations_per_second
        self._pods: dict[str, deque[PodSample]] = {}

    def add(self, sample: PodSample) -> bool:
        """Keep a sample; False (and nothing kept) when it is garbage or not newer than the last one."""
        if not valid_sample(sample):
            return False
        history = self._pods.setdefault(sample.pod, deque())
        if history and sample.at <= history[-1].at:
            return False
        history.append(sample)
        return True

    def has(self, pod: str, at: float) -> bool:
        """True when the pod's history already holds a sample taken at `at` (a repeated scrape)."""
        return any(s.at == at for s in self._pods.get(pod, ()))

    def adopt(self, other: FleetHistory) -> None:
        """Take over another history's samples (settings changed; what was measured still holds)."""
        for pod, samples in other._pods.items():
            self._pods[pod] = deque(samples)

    def prune(self, now: float) -> None:
        """Drop samples older than the horizon; a pod with none left is forgotten.

        The newest sample before the horizon is kept as the baseline of the oldest delta, so a window
        as long as the horizon still covers all of it.
        """
        cutoff = now - self.horizon
        for pod in list(self._pods):
            h = self._pods[pod]
            while len(h) > 1 and h[1].at <= cutoff:
                h.popleft()
            if h and h[-1].at < cutoff:
                del self._pods[pod]

    @property
    def pods(self) -> tuple[str, ...]:
        return tuple(self._pods)

    def classes(self) -> tuple[str, ...]:
        names: set[str] = set()
        for h in self._pods.values():
            for s in h:
                names.update(s.classes)
        return tuple(sorted(names))

    def _in_window(self, pod: str, start: float, now: float) -> list[PodSample]:
        """The pod's samples in (start, now], preceded by the newest one at or before start (the baseline)."""
        out: list[PodSample] = []
        for s in self._pods.get(pod, ()):
            if s.at > now:
                break
            if s.at <= start:
                out = [s]
            else:
                out.append(s)
        return out

    def histogram(self, cls: str, metric: Metric, *, start: float, now: float) -> WindowedHistogram | None:
        """Observations of one class's histogram in (start, now], summed over pods.

        Pods whose buckets differ from the fleet's most common layout are left out (a rollout mixing
        proxy versions); None when no pod has two comparable samples in the window.
        """
        sums: dict[tuple[float, ...], list[float]] = {}
        for pod in self._pods:
            samples = self._in_window(pod, start, now)
            for prev, cur in zip(samples, samples[1:], strict=False):
                a = _pick(prev, cls, metric)
                b = _pick(cur, cls, metric)
                if b is None:
                    continue
                if a is None:
                    # The class appeared between scrapes: its series start at zero on the proxy.
                    a = Histogram(bounds=b.bounds, counts=(0.0,) * len(b.bounds), total=0.0)
                inc = _delta(a, b, cur.at - prev.at, self.max_rate)
                if inc is None:
                    continue
                acc = sums.setdefault(b.bounds, [0.0] * len(b.bounds))
                for i, x in enumerate(inc):
                    acc[i] += x
        if not sums:
            return None
        bounds, counts = max(sums.items(), key=lambda kv: kv[1][-1])
        return WindowedHistogram(bounds=bounds, counts=tuple(counts))

    def latest(self, now: float, max_age: float) -> dict[str, PodSample]:
        """Each pod's newest sample no older than max_age."""
        out: dict[str, PodSample] = {}
        for pod, h in self._pods.items():
            for s in reversed(h):
                if s.at <= now:
                    if now - s.at <= max_age:
                        out[pod] = s
                    break
        return out

    def mean_per_pod(self, gauge: Callable[[PodSample], float | None], *, start: float, now: float) -> dict[str, float]:
        """Each pod's average of one gauge over its samples in (start, now] (pods with none left out)."""
        out: dict[str, float] = {}
        for pod, h in self._pods.items():
            values = [v for s in h if start < s.at <= now and (v := gauge(s)) is not None]
            if values:
                out[pod] = sum(values) / len(values)
        return out


def _pick(s: PodSample, cls: str, metric: Metric) -> Histogram | None:
    m = s.classes.get(cls)
    if m is None:
        return None
    return m.ttft if metric == "ttft" else m.itl


def demand(s: PodSample) -> float:
    """Requests a pod holds: in flight to the engine plus queued in the proxy's class queues."""
    return s.inflight + sum(m.queue_depth for m in s.classes.values())


def waiting(s: PodSample) -> float:
    """Requests a pod holds that have no first token yet: engine waiting plus the proxy's class queues."""
    return (s.engine_waiting or 0.0) + sum(m.queue_depth for m in s.classes.values())


def offered_rate(history: FleetHistory, pods: set[str], *, start: float, now: float) -> tuple[float, float]:
    """Requests offered per second over (start, now], summed over `pods`, and the span measured (s).

    A request leaves the waiting line when its first token is served, so what arrives is what got a first
    token (the TTFT histograms' `_count`, summed over classes) plus the growth of the waiting line
    (engine waiting + proxy queues) plus what the proxy shed for want of capacity (429 on a full queue or
    a predicted SLO miss): a fleet that sheds must not read its own shedding as falling demand. Arrivals are counted per pod over its own samples in the window (a pod
    with one sample there, just ready, adds nothing yet) and summed, over the longest span any pod covered. The span is the longest one any pod covered.
    """
    arrived, span = 0.0, 0.0
    for pod in pods:
        samples = history._in_window(pod, start, now)
        if len(samples) < 2:
            continue
        served = 0.0
        for prev, cur in zip(samples, samples[1:], strict=False):
            for cls in cur.classes:
                b = _pick(cur, cls, "ttft")
                if b is None:
                    continue
                a = _pick(prev, cls, "ttft") or Histogram(bounds=b.bounds, counts=(0.0,) * len(b.bounds), total=0.0)
                inc = _delta(a, b, cur.at - prev.at, history.max_rate)
                served += inc[-1] if inc is not None else 0.0
            for cls, m in cur.classes.items():
                before = prev.classes.get(cls)
                shed = m.shed - before.shed if before is not None and m.shed >= before.shed else m.shed  # reset
                if 0.0 <= shed <= history.max_rate * max(cur.at - prev.at, 1.0):
                    served += shed
        arrived += max(served + waiting(samples[-1]) - waiting(samples[0]), 0.0)
        span = max(span, samples[-1].at - samples[0].at)
    # Arrivals over the fleet's span, not a sum of per-pod rates: a pod that joined late took its share
    # only since then, while the others' rates over the whole span still include what it now takes.
    return (arrived / span if span > 0 else 0.0), span
