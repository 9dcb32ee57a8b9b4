"""The autoscaler's decision: one `FleetObservation` in, one `ScaleDecision` out, per tick.

Latency is not linear in load (it is flat, then goes vertical at the knee), so it cannot say how many
replicas are needed, only whether there are too few. The proportional quantity is demand: requests in
flight plus queued, over a per-replica capacity that starts at `target_inflight_per_replica` (Knative's
concurrency target) and that the SLO signal s = max(p-th TTFT / objective, p-th ITL / objective)
calibrates (`_calibrate`: the knee is where s reaches the up threshold). s decides direction and urgency:

- up when s >= scale_up_threshold (before the knee at 1), to demand / capacity and at least one more
  pod, or when demand, KV usage or engine waiting is over its target;
- down only when s < scale_down_threshold and the load projected onto fewer replicas (demand, KV usage,
  and the part of s above its floor, scaled by ready / proposed) stays under every down threshold: no
  N -> N-1 -> N flapping;
- in between, hold (the band between the two thresholds is the hysteresis).

Then, as the HPA does: the lowest recommendation over the scale-up stabilization window and the highest
over the scale-down one win, the step per decision is bounded, and the result is clamped to [min, max].
Panic (Knative): the short window shows demand or latency `panic_threshold` times over target; it scales
up from the short window at once and never scales down until a stable window passes without a trigger.
Pods still starting count as capacity, so a cold start is not answered with more pods; latency measured
before the ready pods last grew is stale for scaling up, and latency (or engine waiting) while the waiting
line shrinks on pods that carry the rate is the line's, answered by the rate sizing's drain term alone.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from decodeservice.operator.autoscaler.capacity import RateCapacity, RateEstimate
from decodeservice.operator.autoscaler.settings import AutoscalerSettings, Objective
from decodeservice.operator.autoscaler.types import ClassStatus, FleetObservation, PodSample, ScaleDecision
from decodeservice.operator.autoscaler.window import (
    FleetHistory,
    WindowedHistogram,
    demand,
    offered_rate,
    waiting,
)


@dataclass(frozen=True, kw_only=True)
class Load:
    """What the fleet carries, per window, on the ready pods this tick (failed pods not included)."""

    signal_stable: float | None  # worst class s over the stable window (None: no requests)
    signal_recent: float | None  # the same, over the part of it since the ready pods last grew
    signal_panic: float | None  # worst class s over the panic window (None: too few requests)
    worst_class: str | None
    demand_stable: float  # in flight + queued, fleet total, stable-window mean per pod
    demand_panic: float
    kv_usage: float | None  # mean over pods, panic window
    engine_waiting: float | None  # mean per pod, panic window
    rates: RateEstimate  # offered requests/s and the waiting line


def _signal(ttft: WindowedHistogram | None, itl: WindowedHistogram | None, q: float, obj: Objective,
            min_obs: int = 1) -> float | None:
    parts = []
    for h, target in ((ttft, obj.ttft_seconds), (itl, obj.itl_seconds)):
        if h is not None and h.total >= min_obs and (v := h.quantile(q)) is not None:
            parts.append(v / target)
    return max(parts) if parts else None


def _worst(values: Mapping[str, float | None]) -> tuple[str | None, float | None]:
    known = [(v, k) for k, v in values.items() if v is not None]
    if not known:
        return None, None
    v, k = max(known)
    return k, v


class Autoscaler:
    """One per DecodeService, kept across ticks: per-pod histories, recommendations, panic state."""

    def __init__(self, settings: AutoscalerSettings) -> None:
        self._recs: deque[tuple[float, int]] = deque()
        self._sizes: deque[tuple[float, int]] = deque()  # (at, current replicas): the up step's base
        self._panic_until = -math.inf
        self._fresh_since = -math.inf  # latency before this was measured on fewer ready pods
        self._last_ready = 0
        self._last_backlog: float | None = None  # the waiting line a tick ago: is it draining?
        self._first_data_at: float | None = None  # no scale-down before one stable window of data
        self._signals: deque[tuple[float, float]] = deque()  # (at, stable s): the floor's memory
        self._capacity = float(settings.target_inflight_per_replica)  # learned knee, see _calibrate
        self._rate_capacity = RateCapacity()  # learned requests/s per replica at the knee
        self.update_settings(settings)

    @property
    def capacity(self) -> float:
        """In flight + queued per replica the fleet is sized for: the target, or the knee s revealed."""
        return self._capacity

    @property
    def rate_capacity(self) -> float | None:
        """Requests/s one replica sustains at the up threshold, as learned (None: not revealed yet)."""
        return self._rate_capacity.per_replica

    @property
    def settings(self) -> AutoscalerSettings:
        return self._settings

    def update_settings(self, settings: AutoscalerSettings) -> None:
        """The spec changed: new bounds and targets apply from the next tick; the history stays."""
        self._settings = settings
        self._capacity = min(self._capacity, float(settings.target_inflight_per_replica))
        horizon = max(settings.stable_window_seconds, settings.panic_window_seconds) + 2 * settings.interval_seconds
        old = getattr(self, "_history", None)
        self._history = FleetHistory(horizon_seconds=horizon,
                                     max_observations_per_second=settings.max_observations_per_second)
        if old is not None:
            self._history.adopt(old)

    # -- one tick -------------------------------------------------------------------------------------------

    def decide(self, obs: FleetObservation) -> ScaleDecision:
        st = self._settings
        now = float(obs.at)
        current = max(int(obs.current_replicas), 0) if isinstance(obs.current_replicas, int) else 0
        failed = {str(p) for p in obs.failed_pods}
        scraped: set[str] = set()
        if math.isfinite(now):
            for sample in obs.samples:
                if sample.pod in failed or sample.pod in scraped:
                    continue
                if not sample.at <= now or not self._plausible(sample):
                    failed.add(sample.pod)  # from the future (or NaN), or more load than a proxy holds
                elif self._history.add(sample) or self._history.has(sample.pod, sample.at):
                    scraped.add(sample.pod)
                else:
                    failed.add(sample.pod)  # garbage: left out and counted, as a failed scrape
            self._history.prune(now)
        clamped = min(max(current, st.min_replicas), st.max_replicas)
        if not scraped:
            why = "no metrics from any ready pod" if math.isfinite(now) else "observation without a valid time"
            held = f"replicas held at {current}" if clamped == current else f"replicas clamped to {clamped}"
            return ScaleDecision(at=obs.at, current_replicas=current, desired_replicas=clamped,
                                 reason=f"{why} ({len(failed)} failed): {held}", signal=None,
                                 panic=self._panic_until > now, failed_pods=len(failed))

        ready = len(scraped) + len(failed)
        if ready > self._last_ready:
            self._fresh_since = now
        self._last_ready = ready
        if self._first_data_at is None:
            self._first_data_at = now
        statuses, load = self._measure(now, scraped)
        if load.signal_stable is not None:
            self._signals.append((now, load.signal_stable))
        while self._signals and self._signals[0][0] < now - st.floor_memory_seconds:
            self._signals.popleft()

        raw, why = self._recommend(now, current, ready, len(failed), load)
        desired, why = self._stabilize(now, current, raw, why)
        if not st.min_replicas <= desired <= st.max_replicas:
            desired = min(max(desired, st.min_replicas), st.max_replicas)
            why += f" (clamped to [{st.min_replicas}, {st.max_replicas}])"
        if desired != current:
            why = f"{current} -> {desired}: {why}"
        return ScaleDecision(at=obs.at, current_replicas=current, desired_replicas=desired,
                             reason=why, signal=load.signal_stable, panic=self._panic_until > now,
                             classes=statuses, scraped_pods=len(scraped), failed_pods=len(failed))

    def _plausible(self, sample: PodSample) -> bool:
        top = self._settings.max_pod_demand
        try:
            return demand(sample) <= top and (sample.engine_waiting or 0.0) <= top
        except TypeError:
            return False  # not numbers at all

    def _measure(self, now: float, pods: set[str]) -> tuple[dict[str, ClassStatus], Load]:
        st, h = self._settings, self._history
        q = st.percentile / 100.0
        stable_start = now - st.stable_window_seconds
        recent_start = max(stable_start, self._fresh_since)
        panic_start = now - st.panic_window_seconds
        statuses: dict[str, ClassStatus] = {}
        stable: dict[str, float | None] = {}
        recent: dict[str, float | None] = {}
        panic: dict[str, float | None] = {}
        for cls in h.classes():
            obj = st.objective(cls)
            ttft = h.histogram(cls, "ttft", start=stable_start, now=now)
            itl = h.histogram(cls, "itl", start=stable_start, now=now)
            stable[cls] = _signal(ttft, itl, q, obj)
            recent[cls] = _signal(h.histogram(cls, "ttft", start=recent_start, now=now),
                                  h.histogram(cls, "itl", start=recent_start, now=now), q, obj)
            panic[cls] = _signal(h.histogram(cls, "ttft", start=panic_start, now=now),
                                 h.histogram(cls, "itl", start=panic_start, now=now), q, obj,
                                 st.min_panic_observations)
            statuses[cls] = ClassStatus(
                ttft_seconds=ttft.quantile(q) if ttft else None, itl_seconds=itl.quantile(q) if itl else None,
                ttft_attainment=ttft.share_at_most(obj.ttft_seconds) if ttft else None,
                itl_attainment=itl.share_at_most(obj.itl_seconds) if itl else None,
                signal=stable[cls], requests=ttft.total if ttft else 0.0)
        worst_cls, s_stable = _worst(stable)

        def total(gauge_start: float) -> float:
            means = h.mean_per_pod(demand, start=gauge_start, now=now)
            return sum(v for p, v in means.items() if p in pods)

        def mean(read: str) -> float | None:
            means = h.mean_per_pod(lambda s: getattr(s, read), start=panic_start, now=now)
            vals = [v for p, v in means.items() if p in pods]
            return sum(vals) / len(vals) if vals else None

        rate, _ = offered_rate(h, pods, start=stable_start, now=now)
        rate_recent, recent_span = offered_rate(h, pods, start=recent_start, now=now)
        rate_panic, _ = offered_rate(h, pods, start=panic_start, now=now)
        latest = h.latest(now, max_age=st.interval_seconds * 2)
        rates = RateEstimate(rate=rate, rate_recent=rate_recent, rate_panic=rate_panic, recent_span=recent_span,
                             backlog=sum(waiting(s) for p, s in latest.items() if p in pods))
        load = Load(signal_stable=s_stable, signal_recent=_worst(recent)[1], signal_panic=_worst(panic)[1],
                    worst_class=worst_cls, demand_stable=total(stable_start), demand_panic=total(panic_start),
                    kv_usage=mean("kv_cache_usage"), engine_waiting=mean("engine_waiting"), rates=rates)
        return statuses, load

    def _calibrate(self, load: Load, scraped: int) -> None:
        """Learn the demand per replica the engine carries at the up threshold (its knee) from s.

        Starts at target_inflight_per_replica and never exceeds it. A signal at or over the up point at
        per-replica demand d puts the knee at d x threshold / s (s counted at most twice the threshold, so
        a queue explosion halves the estimate at most); a signal under the down point at demand d raises
        the estimate back towards the target, by the same linear projection.
        """
        st = self._settings
        target = float(st.target_inflight_per_replica)
        d = load.demand_stable / scraped if scraped > 0 else 0.0
        up = st.scale_up_threshold
        s_rec, s = load.signal_recent, load.signal_stable
        if d > 0 and s_rec is not None and s_rec >= up:
            self._capacity = max(1.0, min(self._capacity, d * up / min(s_rec, 2 * up)))
        elif d > 0 and s is not None and s < st.scale_down_threshold:
            self._capacity = max(self._capacity, d * up / max(s, 1e-9))
        self._capacity = min(self._capacity, target)

    def _recommend(self, now: float, current: int, ready: int, failed: int, load: Load) -> tuple[int, str]:
        """The raw recommendation for this tick, before stabilization, and why."""
        st = self._settings
        scraped = ready - failed
        self._calibrate(load, scraped)
        cap = self._capacity
        rates = load.rates
        n_panic = self._rate_capacity.replicas_for(rate=max(rates.rate, rates.rate_panic), backlog=rates.backlog,
                                                   utilization=st.target_utilization,
                                                   drain_seconds=st.backlog_drain_seconds)
        # After a step up in load, the line that piled up while new pods started is served late once they
        # are ready: p-th TTFT and engine waiting stay high for a while although the ready pods carry the
        # offered rate. If the line is shrinking and the learned rate says the ready pods carry the rate,
        # that latency and that waiting are the line's: the line gets its own answer (the drain term of
        # the rate sizing) and they ask for no more pods on top, nor teach anything about the knee. A
        # growing line says the pods are short, latency or not.
        backlog_prev, self._last_backlog = self._last_backlog, rates.backlog
        n_rate_alone = self._rate_capacity.replicas_for(rate=max(rates.rate, rates.rate_panic), backlog=0.0,
                                                        utilization=st.target_utilization,
                                                        drain_seconds=st.backlog_drain_seconds)
        draining = (n_rate_alone is not None and n_rate_alone <= ready and backlog_prev is not None
                    and rates.backlog < backlog_prev)
        # While pods are starting the fleet is short on purpose, and in panic (a burst) its latency
        # measures the backlog piling up or draining, not what a replica sustains: nothing is learned then.
        if (rates.recent_span >= 2 * st.interval_seconds and scraped > 0 and current <= ready
                and self._panic_until <= now and not draining):
            self._rate_capacity.observe(rate_per_replica=rates.rate_recent / scraped, signal=load.signal_recent,
                                        up=st.scale_up_threshold, down=st.scale_down_threshold)
        n_rate = self._rate_capacity.replicas_for(rate=rates.rate, backlog=rates.backlog,
                                                  utilization=st.target_utilization,
                                                  drain_seconds=st.backlog_drain_seconds)
        # Failed pods, as the HPA treats missing metrics: no load when scaling up, at target when down.
        d_up = load.demand_stable
        d_panic = load.demand_panic
        s_rec = load.signal_recent
        cls = load.worst_class or "-"
        ups: list[tuple[int, str]] = []
        by_demand = math.ceil(d_up / cap) if n_rate is None else n_rate
        rate_cap = self._rate_capacity.per_replica
        if n_rate is not None and rate_cap is not None:
            if n_rate > current * (1 + st.tolerance):
                ups.append((n_rate, f"offered {rates.rate:.2f} req/s + {rates.backlog:.0f} waiting over "
                                    f"{rate_cap:.2f} req/s per replica at {st.target_utilization:.0%}"))
        elif d_up / cap > current * (1 + st.tolerance):
            ups.append((math.ceil(d_up / cap), f"demand {d_up:.1f} in flight+queued over {cap:.1f} per replica"))
        if s_rec is not None and s_rec >= st.scale_up_threshold and not draining:
            ups.append((max(ready + 1, by_demand),
                        f"SLO signal {s_rec:.2f} ({cls}) >= {st.scale_up_threshold:g}, "
                        f"{cap:.1f} in flight per replica"))
        kv, waiting = load.kv_usage, load.engine_waiting
        if kv is not None and kv > st.kv_usage_threshold:
            ups.append((max(ready + 1, math.ceil(ready * kv / st.kv_usage_threshold)),
                        f"KV cache {kv:.0%} > {st.kv_usage_threshold:.0%}"))
        if waiting is not None and waiting > st.waiting_threshold and not draining:
            ups.append((ready + 1, f"engine waiting {waiting:.1f}/pod > {st.waiting_threshold:g}"))

        s_panic = load.signal_panic
        rate_cap = self._rate_capacity.per_replica
        over = (rates.rate_panic / (rate_cap * max(scraped, 1)) if rate_cap is not None  # backlog is not a burst
                else d_panic / cap / max(scraped, 1))
        # A learned rate can be too low (a breach taught it while a hiccup slowed the pods); a rate "twice
        # over" it with calm short-window latency says the estimate is wrong, not that a burst arrived.
        calm = rate_cap is not None and s_panic is not None and s_panic < st.scale_down_threshold
        trigger = (over >= st.panic_threshold and not calm) or (
            s_panic is not None and s_panic >= st.panic_threshold * st.scale_up_threshold)
        if trigger:
            self._panic_until = now + st.stable_window_seconds
        if self._panic_until > now:
            by_lat = ready + 1 if (s_panic or 0.0) >= st.scale_up_threshold and not draining else 0
            by_load = math.ceil(d_panic / cap) if n_panic is None else n_panic
            ups.append((max(by_load, by_lat),
                        f"panic: short-window demand {d_panic:.1f}, signal {s_panic or 0.0:.2f}"))
        best = max(ups, default=None)
        if best is not None and best[0] > current:
            return best[0], f"up: {best[1]}"
        if best is not None:
            return current, f"hold: {best[1]}, covered by {current} replicas (incl. starting)"
        if self._panic_until > now:
            return current, "hold: panic mode, no scale-down"
        s = load.signal_stable
        if s is not None and s >= self._down_limit():
            return current, f"hold: SLO signal {s:.2f} ({cls}) within [{self._down_limit():g}, " \
                            f"{st.scale_up_threshold:g})"
        if self._first_data_at is None or now - self._first_data_at < st.stable_window_seconds:
            return current, "hold: less than one stable window of data, no scale-down yet"
        return self._project_down(current, ready, failed, load)

    def _down_limit(self) -> float:
        """The signal the load projected onto fewer replicas must stay under.

        Without a learned rate, s alone says how loaded the pods are: under the down threshold. With one,
        the rate sizes the fleet and s only has to stay clear of the up threshold with room to spare (the
        middle of the band), so a fleet at moderate latency can still shed pods the rate does not need.
        """
        st = self._settings
        if self._rate_capacity.per_replica is None:
            return st.scale_down_threshold
        return (st.scale_down_threshold + st.scale_up_threshold) / 2

    def _project_down(self, current: int, ready: int, failed: int, load: Load) -> tuple[int, str]:
        """The fewest replicas onto which the load, projected, stays under every down threshold."""
        st = self._settings
        target = self._capacity
        d_down = max(load.demand_stable, load.demand_panic) + target * failed
        rate_cap = self._rate_capacity.per_replica
        if rate_cap is not None:  # sized on the rate: demand is only its consequence (Little's law)
            target = rate_cap * st.target_utilization
            d_down = max(load.rates.rate, load.rates.rate_panic) + load.rates.backlog / st.backlog_drain_seconds \
                + target * failed
        s = load.signal_stable or 0.0
        floor = min((v for _, v in self._signals), default=0.0)
        floor = min(floor, s)
        kv = load.kv_usage or 0.0
        waiting = load.engine_waiting or 0.0
        margin = 1 - st.tolerance
        limit = self._down_limit()

        def fits(m: int) -> bool:
            r = ready / m  # per-pod load grows by ready / m (linear: optimistic past the knee, hence the band)
            return (d_down / m <= target and floor + (s - floor) * r < limit
                    and kv * r <= st.kv_usage_threshold * margin and waiting * r <= st.waiting_threshold * margin)

        m = current
        while m - 1 >= max(st.min_replicas, 1) and fits(m - 1):
            m -= 1
        if m == current and rate_cap is not None and m - 1 >= max(st.min_replicas, 1):
            # The learned rate only rises by `max_raise` x the rate a replica took, so on its own it would
            # hold a small fleet (2 or 3 pods) above its need forever. Latency can vouch for one step
            # down: the signal projected onto one pod fewer stays under the strict down threshold. The
            # step asserts that m - 1 pods carry the rate, so the learned rate rises to match (or a
            # breach there teaches it back down), and the rate sizing does not undo the step.
            r = ready / (m - 1)
            if (s < st.scale_down_threshold and floor + (s - floor) * r < st.scale_down_threshold
                    and kv * r <= st.kv_usage_threshold * margin and waiting * r <= st.waiting_threshold * margin):
                m -= 1
                self._rate_capacity.per_replica = max(rate_cap, d_down / (m * st.target_utilization))
                return m, (f"down: signal {s:.2f} projects to {floor + (s - floor) * r:.2f} on {m} replicas; "
                           f"learned rate raised to {self._rate_capacity.per_replica:.2f} req/s per replica")
        if m == current:
            if current <= st.min_replicas:
                return current, f"hold: at min_replicas {st.min_replicas}"
            return current, (f"hold: load projected onto {current - 1} replicas would breach a down threshold "
                             f"(signal {floor + (s - floor) * ready / max(current - 1, 1):.2f}, load "
                             f"{d_down / max(current - 1, 1):.2f}/replica)")
        unit = "req/s" if rate_cap is not None else "in flight+queued"
        return m, f"down: signal {s:.2f} and load {d_down:.1f} {unit} fit {m} replicas"

    def _stabilize(self, now: float, current: int, raw: int, why: str) -> tuple[int, str]:
        """HPA rules: lowest rec in the up window, highest in the down window; bounded step; panic."""
        st = self._settings
        self._recs.append((now, raw))
        keep = max(st.scale_up_stabilization_seconds, st.scale_down_stabilization_seconds)
        while self._recs and self._recs[0][0] < now - keep:
            self._recs.popleft()
        up_rec = min(r for t, r in self._recs if t >= now - st.scale_up_stabilization_seconds)
        down_rec = max(r for t, r in self._recs if t >= now - st.scale_down_stabilization_seconds)
        self._sizes.append((now, current))
        while self._sizes and self._sizes[0][0] <= now - st.scale_up_period_seconds:
            self._sizes.popleft()
        if current < up_rec:
            base = min(n for _, n in self._sizes)  # replicas at the start of the period
            step = max(st.max_scale_up_step, math.ceil(base * st.max_scale_up_ratio))
            desired = max(min(up_rec, base + step), current)
            if desired < raw:
                why += f" (step bounded to +{step})"
        elif current > down_rec:
            if self._panic_until > now:
                return current, "hold: panic mode, no scale-down"
            step = max(1, math.floor(current * st.max_scale_down_ratio))
            desired = max(down_rec, current - step)
        else:
            desired = current
            if raw > current:
                why = (f"hold: {why.removeprefix('up: ')}, not yet sustained for "
                       f"{st.scale_up_stabilization_seconds:g} s")
            elif raw < current:
                why = (f"hold: {why.removeprefix('down: ')}, but the highest recommendation in the last "
                       f"{st.scale_down_stabilization_seconds:g} s is {down_rec}")
        return desired, why


__all__ = ["Autoscaler", "AutoscalerSettings", "Load", "Objective"]
