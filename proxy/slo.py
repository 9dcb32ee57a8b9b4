"""Sliding-window latency bookkeeping: SLO attainment per class, and the latency model admission uses.

Both keep timestamped samples in a deque and drop the ones older than the window on every read or write,
so memory stays bounded by the request rate times the window (and by `max_samples`).
"""

from __future__ import annotations

import collections
import dataclasses

from decodeservice.common.stats import percentile
from decodeservice.proxy.policy import PriorityClass, SloPolicy


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RequestOutcome:
    """What one finished request measured at the proxy (seconds)."""

    priority: PriorityClass
    finished: float  # perf_counter timestamp
    ttft: float | None  # from arrival at the proxy (what the client saw); None if no token came
    upstream_ttft: float | None  # from the moment it was sent upstream (what the engine did)
    service_time: float  # upstream start to end, the time it held an in-flight slot
    e2e: float  # arrival at the proxy to the last byte
    itls: tuple[float, ...]  # gaps between token events
    output_tokens: int  # token-carrying stream events (or usage.completion_tokens when not streaming)
    # False for a non-streamed answer: it arrives whole, so it has no first token or gaps to judge.
    streamed: bool = True


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Verdict:
    """Whether one request met each objective: what the window averages and the SLO counters count."""

    ttft: bool
    itl: bool


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Attainment:
    ttft: float
    itl: float
    all: float
    requests: int


class SloTracker:
    """Fraction of recent requests that met the TTFT and ITL objectives, per priority class.

    A request meets the ITL objective when the policy's percentile of its own token gaps is within
    `itlMs` (one stall in a long answer does not fail it at p95). A stream with no token fails TTFT.
    A non-streamed answer is not judged at all: its time to the whole body is neither a first token nor
    a gap, and counting it against `ttftMs` would call every fast non-streamed request a miss.
    """

    def __init__(self, slo: SloPolicy, *, max_samples: int = 10_000):
        self._slo = slo
        self._samples: dict[PriorityClass, collections.deque[tuple[float, bool, bool]]] = {
            p: collections.deque(maxlen=max_samples) for p in PriorityClass
        }

    def record(self, outcome: RequestOutcome) -> Verdict | None:
        """The request's verdict, kept in the window; None (and nothing kept) for a non-streamed one."""
        if not outcome.streamed:
            return None
        ttft_ok = outcome.ttft is not None and outcome.ttft * 1000.0 <= self._slo.ttft_ms
        itl_ok = not outcome.itls or percentile(outcome.itls, self._slo.percentile) * 1000.0 <= (
            self._slo.itl_ms
        )
        self._samples[outcome.priority].append((outcome.finished, ttft_ok, itl_ok))
        return Verdict(ttft=ttft_ok, itl=itl_ok)

    def attainment(self, priority: PriorityClass, *, now: float) -> Attainment | None:
        samples = self._samples[priority]
        horizon = now - self._slo.window_seconds
        while samples and samples[0][0] < horizon:
            samples.popleft()
        if not samples:
            return None
        n = len(samples)
        ttft = sum(1 for _, t, _ in samples if t) / n
        itl = sum(1 for _, _, i in samples if i) / n
        both = sum(1 for _, t, i in samples if t and i) / n
        return Attainment(ttft=ttft, itl=itl, all=both, requests=n)


class LatencyModel:
    """Recent upstream TTFT and slot holding time, from which admission predicts a newcomer's TTFT."""

    def __init__(self, *, window_seconds: float, max_samples: int = 512):
        self._window = window_seconds
        self._ttfts: collections.deque[tuple[float, float]] = collections.deque(maxlen=max_samples)
        self._service: collections.deque[tuple[float, float]] = collections.deque(maxlen=max_samples)

    def record(self, outcome: RequestOutcome) -> None:
        if outcome.upstream_ttft is not None:
            self._ttfts.append((outcome.finished, outcome.upstream_ttft))
        self._service.append((outcome.finished, outcome.service_time))

    def _prune(self, now: float) -> None:
        horizon = now - self._window
        for samples in (self._ttfts, self._service):
            while samples and samples[0][0] < horizon:
                samples.popleft()

    def ttft_quantile(self, q: float, *, now: float) -> float | None:
        self._prune(now)
        return percentile((v for _, v in self._ttfts), q * 100.0) if self._ttfts else None

    def mean_service_time(self, *, now: float) -> float | None:
        self._prune(now)
        return sum(v for _, v in self._service) / len(self._service) if self._service else None
