"""The queueing model behind `autoscale_sim.py`: replicas that batch continuously, with measured costs.

One replica is an engine step loop. Each step decodes one token for every running sequence and prefills
the prompts admitted at its start (at most `max_num_seqs` running), and lasts

    step = base + per_seq x (running + admitted) + prefill x admitted

so TTFT grows with the queue (a prompt waits for a free slot, then for its prefill step) and ITL grows
with the batch. `base`, `per_seq` and `prefill` are fitted to a profile measured on the real engine with
`decodectl bench` (`EngineProfile.load`). In front of the engine sits the proxy as the operator sees it:
up to `proxy_max_inflight` requests are in flight to the engine (running + engine-waiting), the rest
wait in the proxy's class queues (interactive before batch); a full class queue sheds with 429 (counted
as a miss; the proxy's SLO-predictive shedding is not modelled). Each pod exposes the real proxy's cumulative histograms (same bucket bounds) to the scrape.

A request meets its SLO when its TTFT and the 95th percentile of its own token gaps are within its class's
objectives, as the proxy's `SloTracker` judges it.
"""

from __future__ import annotations

import bisect
import heapq
import json
import math
import random
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from decodeservice.operator.autoscaler.types import ClassMetrics, Histogram, PodSample
from decodeservice.proxy.metrics import ITL_BUCKETS, TTFT_BUCKETS

CLASSES = ("interactive", "batch")
PROXY_MAX_QUEUE = {"interactive": 64, "batch": 256}  # the proxy's default classes.*.maxQueue
ITL_PERCENTILE = 0.95  # a request meets the ITL objective when its p95 gap does (the proxy's SloTracker)
TTFT_BOUNDS = (*TTFT_BUCKETS, math.inf)
ITL_BOUNDS = (*ITL_BUCKETS, math.inf)


@dataclass(frozen=True, kw_only=True)
class EngineProfile:
    base_s: float  # step time with an empty batch (intercept of the fit)
    per_seq_s: float  # added per sequence in the step
    prefill_s: float  # added per prompt prefilled in the step (the bench's chat prompts)
    max_num_seqs: int
    kv_capacity_tokens: int

    def step(self, running: int, admitted: int) -> float:
        return self.base_s + self.per_seq_s * (running + admitted) + self.prefill_s * admitted

    @classmethod
    def load(cls, path: Path) -> EngineProfile:
        """Least-squares fit of mean TPOT against concurrency; prefill = TTFT at c=1 minus one step."""
        doc = json.loads(path.read_text())
        pts = [(float(p["concurrency"]), p["tpot_mean_ms"] / 1000) for p in doc["points"]]
        n = len(pts)
        mx = sum(x for x, _ in pts) / n
        my = sum(y for _, y in pts) / n
        slope = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
        base = my - slope * mx
        c1 = min(doc["points"], key=lambda p: p["concurrency"])
        prefill = max(c1["ttft_mean_ms"] / 1000 - (base + slope * c1["concurrency"]), 0.0)
        return cls(base_s=base, per_seq_s=slope, prefill_s=prefill, max_num_seqs=int(doc["max_num_seqs"]),
                   kv_capacity_tokens=int(doc["kv_capacity_tokens"]))


@dataclass(frozen=True, kw_only=True)
class Objectives:
    ttft_s: float
    itl_s: float


@dataclass(kw_only=True)
class Request:
    arrival: float
    cls: str
    prompt_tokens: int
    output_tokens: int
    first_token_at: float = math.nan
    slow0: int = 0  # the replica's count of steps slower than this class's ITL objective, at the first token


@dataclass(kw_only=True)
class Outcomes:
    """Per class: requests finished and requests that met both objectives."""

    total: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CLASSES, 0))
    met: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CLASSES, 0))


class _CumHist:
    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0.0] * len(bounds)

    def observe(self, v: float, n: float = 1.0) -> None:
        self.counts[bisect.bisect_left(self.bounds, v)] += n

    def snapshot(self) -> Histogram:
        cum, acc = [], 0.0
        for c in self.counts:
            acc += c
            cum.append(acc)
        return Histogram(bounds=self.bounds, counts=tuple(cum), total=acc)


class Replica:
    """One pod: proxy queue + engine step loop. Steps are driven by `Fleet` through `step_end`."""

    def __init__(self, name: str, *, profile: EngineProfile, created: float, ready_at: float,
                 objectives: dict[str, Objectives], outcomes: Outcomes, proxy_max_inflight: int = 64) -> None:
        self.name, self.profile, self.created, self.ready_at = name, profile, created, ready_at
        self.objectives, self.outcomes, self.proxy_max_inflight = objectives, outcomes, proxy_max_inflight
        self.draining = False
        self.waiting: dict[str, deque[Request]] = {c: deque() for c in CLASSES}
        self.running: list[tuple[int, int, Request]] = []  # heap of (finishing step, seq, request)
        self.running_by_class = dict.fromkeys(CLASSES, 0)
        self.slow_steps = dict.fromkeys(CLASSES, 0)  # steps over each class's ITL objective, cumulative
        self.shed = dict.fromkeys(CLASSES, 0)  # 429s on a full class queue, cumulative (the proxy's counter)
        self.steps = 0
        self.kv_tokens = 0
        self.busy_until: float | None = None  # end of the step in progress
        self._admitted: list[Request] = []
        self._seq = 0
        self.ttft = {c: _CumHist(TTFT_BOUNDS) for c in CLASSES}
        self.itl = {c: _CumHist(ITL_BOUNDS) for c in CLASSES}

    @property
    def load(self) -> int:
        return len(self.running) + sum(len(q) for q in self.waiting.values())

    def _proxy_queues(self) -> dict[str, int]:
        """Requests waiting in the proxy's class queues: beyond the engine's running + waiting slots."""
        forward = max(self.proxy_max_inflight - len(self.running), 0)
        queued: dict[str, int] = {}
        for c in CLASSES:  # the proxy forwards interactive first; the rest waits in its class queue
            n = len(self.waiting[c])
            queued[c] = max(n - forward, 0)
            forward = max(forward - n, 0)
        return queued

    def add(self, req: Request, now: float) -> float | None:
        """Queue a request; the end time of a newly started step, if the engine was idle.

        A full class queue sheds the request with 429, as the proxy does (a miss for its SLO).
        """
        if self._proxy_queues()[req.cls] >= PROXY_MAX_QUEUE[req.cls]:
            self.outcomes.total[req.cls] += 1
            self.shed[req.cls] += 1
            return None
        self.waiting[req.cls].append(req)
        return self._start(now) if self.busy_until is None else None

    def _start(self, now: float) -> float | None:
        free = self.profile.max_num_seqs - len(self.running)
        self._admitted = []
        for c in CLASSES:  # interactive first: the proxy's priority order
            q = self.waiting[c]
            while free > 0 and q:
                self._admitted.append(q.popleft())
                free -= 1
        if not self.running and not self._admitted:
            self.busy_until = None
            return None
        self.busy_until = now + self.profile.step(len(self.running), len(self._admitted))
        return self.busy_until

    def step_end(self, now: float) -> float | None:
        """Finish the step in progress at `now`; start the next one and return its end (None: idle)."""
        d = self.profile.step(len(self.running), len(self._admitted))
        for c, n in self.running_by_class.items():
            if n:
                self.itl[c].observe(d, n)
        self.kv_tokens += len(self.running)
        for c, o in self.objectives.items():
            self.slow_steps[c] += d > o.itl_s
        self.steps += 1
        for r in self._admitted:
            r.first_token_at = now
            r.slow0 = self.slow_steps[r.cls]
            self.ttft[r.cls].observe(now - r.arrival)
            self.kv_tokens += r.prompt_tokens + 1
            self.running_by_class[r.cls] += 1
            self._seq += 1
            heapq.heappush(self.running, (self.steps + r.output_tokens - 1, self._seq, r))
        while self.running and self.running[0][0] <= self.steps:
            _, _, r = heapq.heappop(self.running)
            self.running_by_class[r.cls] -= 1
            self.kv_tokens -= r.prompt_tokens + r.output_tokens
            self._finish(r)
        return self._start(now)

    def _finish(self, r: Request) -> None:
        obj = self.objectives[r.cls]
        gaps = r.output_tokens - 1
        slow = self.slow_steps[r.cls] - r.slow0  # every running request sees every step as one gap
        self.outcomes.total[r.cls] += 1
        if r.first_token_at - r.arrival <= obj.ttft_s and slow <= (1 - ITL_PERCENTILE) * gaps:
            self.outcomes.met[r.cls] += 1

    def sample(self, now: float) -> PodSample:
        """What the proxy's /metrics says now, as the operator's scrape parses it."""
        running = len(self.running)
        queued = self._proxy_queues()
        waiting_total = sum(len(q) for q in self.waiting.values())
        engine_waiting = waiting_total - sum(queued.values())
        return PodSample(
            pod=self.name, at=now, inflight=float(running + engine_waiting),
            classes={c: ClassMetrics(ttft=self.ttft[c].snapshot(), itl=self.itl[c].snapshot(),
                                     queue_depth=float(queued[c]), shed=float(self.shed[c])) for c in CLASSES},
            kv_cache_usage=min(self.kv_tokens / self.profile.kv_capacity_tokens, 1.0),
            engine_waiting=float(engine_waiting), engine_running=float(running))


# -- traces --------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Trace:
    name: str
    duration_s: float
    knots: tuple[tuple[float, float], ...]  # (time s, requests/s), linear in between
    batch_share: float = 0.3

    def rate(self, t: float) -> float:
        k = self.knots
        i = bisect.bisect_right([x for x, _ in k], t)
        if i == 0:
            return k[0][1]
        if i == len(k):
            return k[-1][1]
        (t0, r0), (t1, r1) = k[i - 1], k[i]
        return r0 + (r1 - r0) * (t - t0) / (t1 - t0) if t1 > t0 else r1

    @property
    def peak(self) -> float:
        return max(r for _, r in self.knots)

    def arrivals(self, seed: int) -> list[Request]:
        """Poisson arrivals at rate(t) by thinning; interactive chats and longer batch generations."""
        rng = random.Random(seed)
        out: list[Request] = []
        t, top = 0.0, self.peak
        while True:
            t += rng.expovariate(top)
            if t >= self.duration_s:
                return out
            if rng.random() * top > self.rate(t):
                continue
            if rng.random() < self.batch_share:
                out.append(Request(arrival=t, cls="batch", prompt_tokens=rng.randint(200, 600),
                                   output_tokens=rng.randint(128, 384)))
            else:
                out.append(Request(arrival=t, cls="interactive", prompt_tokens=rng.randint(40, 200),
                                   output_tokens=rng.randint(16, 128)))


def staged(levels: list[float], stage_s: float, name: str = "staged ramp") -> Trace:
    knots: list[tuple[float, float]] = []
    for i, r in enumerate(levels):
        knots += [(i * stage_s, r), ((i + 1) * stage_s - 1e-3, r)]
    return Trace(name=name, duration_s=len(levels) * stage_s, knots=tuple(knots))


def day(low: float, high: float, period_s: float) -> Trace:
    """A compressed day: night trough, morning rise, a lunch dip, afternoon peak, evening fall."""
    shape = [0.0, 0.05, 0.3, 0.8, 0.9, 0.7, 0.95, 1.0, 0.75, 0.4, 0.15, 0.05, 0.0]
    step = period_s / (len(shape) - 1)
    return Trace(name="day-shaped", duration_s=period_s,
                 knots=tuple((i * step, low + (high - low) * v) for i, v in enumerate(shape)))


def bursts(base: float, peak: float, at: list[float], length_s: float, duration_s: float) -> Trace:
    knots = [(0.0, base)]
    for t in at:  # near-vertical edges: a burst arrives within a second
        knots += [(t, base), (t + 1, peak), (t + length_s, peak), (t + length_s + 1, base)]
    knots.append((duration_s, base))
    return Trace(name="sudden bursts", duration_s=duration_s, knots=tuple(knots))


def constant(rate: float, duration_s: float) -> Trace:
    return Trace(name=f"constant {rate:.2f}/s", duration_s=duration_s, knots=((0.0, rate), (duration_s, rate)))
