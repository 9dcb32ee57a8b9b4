"""Autoscaling policies replayed through a queueing model of replicas: SLO attainment vs replica-minutes.

The decision code under test is the operator's own (`decodeservice.operator.autoscaler.decide.Autoscaler`),
fed `FleetObservation`s scraped every interval from simulated proxies (`autoscale_model.py`: continuous
batching with step costs fitted to `benchmarks/results/engine_profile_cpu2.json`, measured with `decodectl
bench` on the real engine). Pods take `--warmup` seconds (100) from creation to ready; a pod being removed
stops taking requests and drains. Requests go to a random ready pod (a Kubernetes Service).

Policies, side by side on the same arrivals:
1. fixed replicas sized for the trace's peak (the replica count whose per-replica rate met 95% in a
   one-replica sweep);
2. an HPA-style utilization scaler (per-pod averages of KV usage, target 0.8, and engine waiting requests,
   at a few targets; the HPA's default behavior: 15 s sync, 10% tolerance, up by max(100%, 4 pods) per
   period, 300 s scale-down stabilization, missing metrics at 0 up / at target down);
3. ours;
4. a reference, not a policy one could run: an oracle that knows the trace's true rate at each tick and
   asks for exactly ceil(rate / one replica's sustainable rate) replicas, with no stabilization. Its pods
   still take the warm-up, and it keeps no headroom: it shows what reacting alone, even to the exact rate,
   is worth on a trace (on sudden bursts, little: the warm-up eats most of each burst).

    .venv/bin/python -P benchmarks/autoscale_sim.py --out benchmarks/results/autoscale_sim.json
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))  # `python -P` leaves the script's folder off the path
from autoscale_model import (
    CLASSES,
    EngineProfile,
    Objectives,
    Outcomes,
    Replica,
    Request,
    Trace,
    bursts,
    constant,
    day,
    staged,
)

from decodeservice.operator.autoscaler.decide import Autoscaler, AutoscalerSettings, Objective
from decodeservice.operator.autoscaler.types import FleetObservation

RESULTS = Path(__file__).parent / "results"
OBJECTIVES = {"interactive": Objectives(ttft_s=1.0, itl_s=0.2), "batch": Objectives(ttft_s=5.0, itl_s=0.2)}
Policy = Callable[[FleetObservation], int]
PLOTTED_HPA = "hpa (kv 0.8, waiting 4)"


@dataclass(kw_only=True)
class RunResult:
    attainment: float
    by_class: dict[str, float]
    replica_minutes: float
    reversals: int
    max_replicas: int
    series: list[tuple[float, int]] = field(default_factory=list)  # (t, replicas) after each tick

    def summary(self) -> dict[str, Any]:
        return {"attainment": round(self.attainment, 4), "by_class": {k: round(v, 4) for k, v in self.by_class.items()},
                "replica_minutes": round(self.replica_minutes, 1), "reversals": self.reversals,
                "max_replicas": self.max_replicas}


def simulate(trace: Trace, policy: Policy, *, profile: EngineProfile, initial: int, seed: int,
             interval: float = 5.0, warmup: float = 100.0) -> RunResult:
    """Replay the trace's arrivals through a fleet that `policy` resizes every `interval` seconds."""
    import heapq

    rng = random.Random(seed + 1)
    outcomes = Outcomes()
    arrivals: deque[Request] = deque(trace.arrivals(seed))
    pods: list[Replica] = []
    retired: list[tuple[float, float]] = []  # (created, gone) of removed pods
    steps: list[tuple[float, int, Replica]] = []  # heap of step ends
    serial = 0

    def new_pod(now: float, ready_at: float) -> None:
        nonlocal serial
        serial += 1
        pods.append(Replica(f"pod-{serial}", profile=profile, created=now, ready_at=ready_at,
                            objectives=OBJECTIVES, outcomes=outcomes))

    def schedule(end: float | None, pod: Replica) -> None:
        if end is not None:
            heapq.heappush(steps, (end, id(pod), pod))

    for _ in range(initial):
        new_pod(0.0, 0.0)
    series: list[tuple[float, int]] = []
    changes: list[int] = []
    next_tick = interval
    horizon = trace.duration_s
    while True:
        t_arr = arrivals[0].arrival if arrivals else math.inf
        t_step = steps[0][0] if steps else math.inf
        if next_tick > horizon and not arrivals and not steps:
            break
        now = min(t_arr, t_step, next_tick if next_tick <= horizon else math.inf)
        if now == t_step:
            _, _, pod = heapq.heappop(steps)
            schedule(pod.step_end(now), pod)
            if pod.draining and pod.load == 0 and pod.busy_until is None:
                pods.remove(pod)
                retired.append((pod.created, now))
        elif now == t_arr:
            req = arrivals.popleft()
            ready = [p for p in pods if not p.draining and p.ready_at <= now]
            pod = rng.choice(ready or [p for p in pods if not p.draining])
            schedule(pod.add(req, now), pod)
        else:
            next_tick += interval
            live = [p for p in pods if not p.draining]
            ready = [p for p in live if p.ready_at <= now]
            obs = FleetObservation(at=now, current_replicas=len(live), samples=[p.sample(now) for p in ready],
                                   starting_pods=len(live) - len(ready))
            desired = policy(obs)
            if desired > len(live):
                for _ in range(desired - len(live)):
                    new_pod(now, now + warmup)
            elif desired < len(live):
                # Like a ReplicaSet: pods not ready go first, then the newest.
                victims = sorted(live, key=lambda p: (p.ready_at <= now, -p.created))[: len(live) - desired]
                for p in victims:
                    p.draining = True
                    if p.load == 0 and p.busy_until is None:
                        pods.remove(p)
                        retired.append((p.created, now))
            if desired != len(live):
                changes.append(1 if desired > len(live) else -1)
            series.append((now, desired))
    life = [(p.created, horizon) for p in pods] + retired
    rm = sum(max(min(end, horizon) - start, 0.0) for start, end in life) / 60
    reversals = sum(1 for a, b in zip(changes, changes[1:], strict=False) if a != b)
    total = sum(outcomes.total.values())
    return RunResult(attainment=sum(outcomes.met.values()) / max(total, 1),
                     by_class={c: outcomes.met[c] / max(outcomes.total[c], 1) for c in CLASSES},
                     replica_minutes=rm, reversals=reversals,
                     max_replicas=max([n for _, n in series] + [initial]), series=series)


class HpaLike:
    """The HPA's algorithm on per-pod averages of KV usage and engine waiting requests."""

    def __init__(self, *, waiting_target: float, kv_target: float = 0.8, min_replicas: int, max_replicas: int,
                 initial: int, sync: float = 15.0, tolerance: float = 0.1, down_window: float = 300.0) -> None:
        self.targets = {"kv_cache_usage": kv_target, "engine_waiting": waiting_target}
        self.min, self.max, self.sync, self.tol, self.down_window = min_replicas, max_replicas, sync, tolerance, down_window
        self.next_sync = 0.0
        self.recs: deque[tuple[float, int]] = deque([(0.0, initial)])  # as if it had been running

    def _metric(self, obs: FleetObservation, name: str, target: float, current: int) -> int:
        values = [float(getattr(s, name) or 0.0) for s in obs.samples]
        if not values:
            return current
        ratio = sum(values) / len(values) / target
        missing = obs.starting_pods  # not ready: no metrics; 0 when scaling up, at target when down
        if missing and ratio > 1:
            ratio = sum(values) / (target * (len(values) + missing))
        elif missing and ratio < 1:
            ratio = (sum(values) + target * missing) / (target * (len(values) + missing))
        if abs(ratio - 1) <= self.tol:
            return current
        return math.ceil(ratio * (len(values) + missing))

    def __call__(self, obs: FleetObservation) -> int:
        current = obs.current_replicas
        if obs.at < self.next_sync:
            return current
        self.next_sync = obs.at + self.sync
        rec = max(self._metric(obs, n, t, current) for n, t in self.targets.items())
        rec = min(max(rec, self.min), self.max)
        self.recs.append((obs.at, rec))
        while self.recs[0][0] < obs.at - self.down_window:
            self.recs.popleft()
        if rec > current:
            return min(rec, max(2 * current, current + 4))
        return min(max(r for _, r in self.recs), current)


class Ours:
    def __init__(self, settings: AutoscalerSettings) -> None:
        self.scaler = Autoscaler(settings)
        self.panic_ticks = 0

    def __call__(self, obs: FleetObservation) -> int:
        d = self.scaler.decide(obs)
        self.panic_ticks += d.panic
        return d.desired_replicas


def sustainable_rate(profile: EngineProfile, *, seed: int) -> float:
    """Highest request rate one replica serves at >= 95% attainment (bisection on a 10-minute trace)."""
    lo, hi = 0.05, 10.0
    for _ in range(10):
        mid = (lo + hi) / 2
        r = simulate(constant(mid, 600.0), lambda o: 1, profile=profile, initial=1, seed=seed)
        lo, hi = (mid, hi) if r.attainment >= 0.95 else (lo, mid)
    return lo


def ours_settings(min_r: int, max_r: int, target: int, **thresholds: float) -> AutoscalerSettings:
    """The defaults, with the sim's objectives (and, for a sweep, other thresholds)."""
    i, b = OBJECTIVES["interactive"], OBJECTIVES["batch"]
    return AutoscalerSettings(min_replicas=min_r, max_replicas=max_r, ttft_seconds=i.ttft_s, itl_seconds=i.itl_s,
                              class_objectives={"batch": Objective(ttft_seconds=b.ttft_s, itl_seconds=b.itl_s)},
                              target_inflight_per_replica=target, **thresholds)


def traces(r1: float) -> list[Trace]:
    """Rates in units of one replica's sustainable rate r1, so the shapes do not depend on the machine."""
    return [
        staged([x * r1 for x in (1, 2, 4, 6, 8, 6, 4, 2, 1)], 600.0),
        day(0.8 * r1, 8 * r1, 7200.0),
        bursts(2 * r1, 7 * r1, [900.0, 2700.0, 4500.0], 180.0, 5400.0),
    ]


def edge_traces(r1: float) -> list[Trace]:
    return [constant(x * r1, 1800.0) for x in (2.5, 3.5, 5.5)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--profile", type=Path, default=RESULTS / "engine_profile_cpu2.json")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--target-inflight", type=int, default=16, help="ours: targetInflightPerReplica")
    ap.add_argument("--scale-up-threshold", type=float, default=None, help="ours (default: the setting's)")
    ap.add_argument("--scale-down-threshold", type=float, default=None, help="ours (default: the setting's)")
    ap.add_argument("--hpa-waiting-targets", default="1,4,8", help="the HPA variants' waiting targets per pod")
    ap.add_argument("--more-seeds", default="2,3,4,5",
                    help="ours alone on the same traces with these arrival seeds too: how robust the figures are "
                         "('' to skip)")
    ap.add_argument("--out", type=Path, default=RESULTS / "autoscale_sim.json")
    ap.add_argument("--plot", type=Path, default=None, help="PNG (default: --out with .png)")
    ap.add_argument("--build-profile", nargs="+", type=Path, metavar="REPORT_JSON",
                    help="write --profile from `decodectl bench` report.json files (one per concurrency) and exit")
    ap.add_argument("--max-num-seqs", type=int, default=32, help="with --build-profile: the engine's setting")
    ap.add_argument("--kv-capacity-tokens", type=int, default=23296,
                    help="with --build-profile: KV cache tokens (CPU default 1 GiB / 46080 B per token of "
                         "SmolLM2-135M in float32 = 1456 blocks of 16)")
    args = ap.parse_args(argv)
    if args.build_profile:
        args.profile.write_text(json.dumps(_profile_doc(args), indent=2) + "\n")
        print(f"wrote {args.profile}")
        return 0
    profile = EngineProfile.load(args.profile)
    r1 = sustainable_rate(profile, seed=args.seed)
    thresholds = {k: v for k, v in (("scale_up_threshold", args.scale_up_threshold),
                                    ("scale_down_threshold", args.scale_down_threshold)) if v is not None}
    report: dict[str, Any] = {"profile": vars(profile) | {"source": str(args.profile)}, "objectives": {
        c: vars(o) for c, o in OBJECTIVES.items()}, "replica_rate_at_95pct": round(r1, 3),
        "target_inflight_per_replica": args.target_inflight, "ours_settings": {
            k: v for k, v in vars(ours_settings(1, 1, args.target_inflight, **thresholds)).items()
            if k not in ("min_replicas", "max_replicas", "class_objectives")}, "traces": {}}
    plots: dict[str, dict[str, list[tuple[float, int]]]] = {}
    waits = [float(x) for x in args.hpa_waiting_targets.split(",")]
    for trace in traces(r1) + edge_traces(r1):
        peak_n = math.ceil(trace.peak / r1 - 1e-9)
        start_n = max(math.ceil(trace.rate(0.0) / r1 - 1e-9), 1)
        lim = (1, 2 * peak_n)
        runs: dict[str, RunResult] = {
            f"fixed ({peak_n}, peak-sized)": simulate(trace, lambda o, n=peak_n: n, profile=profile,
                                                      initial=peak_n, seed=args.seed)}
        for w in waits:
            runs[f"hpa (kv 0.8, waiting {w:g})"] = simulate(
                trace, HpaLike(waiting_target=w, min_replicas=lim[0], max_replicas=lim[1], initial=start_n),
                profile=profile, initial=start_n, seed=args.seed)
        ours = Ours(ours_settings(*lim, args.target_inflight, **thresholds))
        runs["ours"] = simulate(trace, ours, profile=profile, initial=start_n, seed=args.seed)
        runs["oracle (exact rate, no headroom)"] = simulate(
            trace, lambda o, tr=trace: max(math.ceil(tr.rate(o.at) / r1 - 1e-9), 1), profile=profile,
            initial=start_n, seed=args.seed)
        fixed_rm = next(iter(runs.values())).replica_minutes
        entry = {name: r.summary() | {"replica_minutes_vs_fixed": round(r.replica_minutes / fixed_rm, 3)}
                 for name, r in runs.items()}
        entry["ours"]["panic_ticks"] = ours.panic_ticks
        report["traces"][trace.name] = {"peak_rate": round(trace.peak, 3), "duration_s": trace.duration_s,
                                        "policies": entry, "targets": _targets(runs)}
        plots[trace.name] = {n: r.series for n, r in runs.items()} | {
            "_rate": [(t, trace.rate(t)) for t in range(0, int(trace.duration_s), 10)]}  # type: ignore[dict-item]
        print(f"{trace.name}: " + "; ".join(f"{n}: {r.attainment:.1%} {r.replica_minutes:.0f} rm "
                                           f"{r.reversals} rev" for n, r in runs.items()), flush=True)
    report["ours_other_seeds"] = _other_seeds(args, profile, r1, thresholds)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    _plot(plots, args.plot or args.out.with_suffix(".png"), r1)
    return 0


def _other_seeds(args: argparse.Namespace, profile: EngineProfile, r1: float,
                 thresholds: dict[str, float]) -> dict[str, list[dict[str, Any]]]:
    """Ours on every trace with other Poisson arrivals: attainment, replica-minutes vs peak-sized, reversals."""
    out: dict[str, list[dict[str, Any]]] = {}
    for seed in (int(x) for x in args.more_seeds.split(",") if x.strip()):
        for trace in traces(r1) + edge_traces(r1):
            peak_n = math.ceil(trace.peak / r1 - 1e-9)
            start_n = max(math.ceil(trace.rate(0.0) / r1 - 1e-9), 1)
            r = simulate(trace, Ours(ours_settings(1, 2 * peak_n, args.target_inflight, **thresholds)),
                         profile=profile, initial=start_n, seed=seed)
            out.setdefault(trace.name, []).append({
                "seed": seed, "attainment": round(r.attainment, 4), "reversals": r.reversals,
                "replica_minutes_vs_fixed": round(r.replica_minutes / (peak_n * trace.duration_s / 60), 3)})
        print(f"seed {seed}: " + "; ".join(f"{n}: {v[-1]['attainment']:.1%} at {v[-1]['replica_minutes_vs_fixed']}x"
                                          for n, v in out.items()), flush=True)
    return out


def _profile_doc(args: argparse.Namespace) -> dict[str, Any]:
    points = []
    settings: dict[str, Any] = {}
    for path in args.build_profile:
        doc = json.loads(path.read_text())
        settings = doc["settings"]
        for lv in doc["levels"]:
            points.append({"concurrency": int(lv["label"].removeprefix("c=")), "requests": lv["completed"],
                           "request_throughput": lv["request_throughput"],
                           "output_throughput": lv["output_throughput"],
                           "ttft_mean_ms": lv["ttft"]["mean"], "ttft_p50_ms": lv["ttft"]["p50"],
                           "ttft_p90_ms": lv["ttft"]["p90"], "tpot_mean_ms": lv["tpot"]["mean"],
                           "itl_p50_ms": lv["itl"]["p50"], "itl_p90_ms": lv["itl"]["p90"]})
    return {"engine": f"decodectl engine --model {settings.get('model')} --max-num-seqs {args.max_num_seqs}",
            "bench": {k: settings.get(k) for k in ("dataset", "max_tokens", "request options", "seed")},
            "note": "2 CPU cores shared with other jobs while measuring (load average ~8-10): absolute "
                    "figures are slow and noisy; the sim uses the shape (step cost vs batch, prefill cost).",
            "max_num_seqs": args.max_num_seqs, "kv_capacity_tokens": args.kv_capacity_tokens,
            "points": sorted(points, key=lambda p: p["concurrency"])}


def _targets(runs: dict[str, RunResult]) -> dict[str, Any]:
    """The autoscaler's targets, judged on this trace: vs the peak-sized fleet and vs the HPA variants."""
    names = list(runs)
    fixed, ours = runs[names[0]], runs["ours"]
    hpa = sorted((r.replica_minutes, r.attainment) for n, r in runs.items() if n.startswith("hpa"))
    out: dict[str, Any] = {"attainment_ge_95": ours.attainment >= 0.95,
                           "replica_minutes_le_0.70x_fixed": ours.replica_minutes <= 0.70 * fixed.replica_minutes}
    # HPA attainment at ours' replica-minutes, and HPA replica-minutes at ours' attainment, by linear
    # interpolation between the HPA variants; None when ours lies outside their range.
    att_at = _interp([(rm, a) for rm, a in hpa], ours.replica_minutes)
    rm_at = _interp(sorted((a, rm) for rm, a in hpa), ours.attainment)
    out["hpa_attainment_at_our_replica_minutes"] = None if att_at is None else round(att_at, 4)
    out["hpa_replica_minutes_at_our_attainment"] = None if rm_at is None else round(rm_at, 1)
    # Outside that range, an HPA variant that used at least our replica-minutes and still attained 5
    # points less is beaten at the same replica-minutes too, unless the HPA's attainment fell with more pods.
    more = [a for rm, a in hpa if rm >= ours.replica_minutes]
    out["hpa_best_attainment_with_more_replica_minutes"] = round(max(more), 4) if more else None
    if att_at is not None:
        out["ge_5_points_over_hpa"] = ours.attainment - att_at >= 0.05
    else:
        out["ge_5_points_over_hpa"] = None if not more else ours.attainment - max(more) >= 0.05
    out["le_0.90x_hpa_replica_minutes"] = None if rm_at is None else ours.replica_minutes <= 0.9 * rm_at
    out["zero_reversals"] = ours.reversals == 0
    return out


def _interp(points: list[tuple[float, float]], x: float) -> float | None:
    for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return None


def _plot(plots: dict[str, dict[str, list[tuple[float, int]]]], path: Path, r1: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(plots), 1, figsize=(10, 2.6 * len(plots)), sharex=False)
    for ax, (name, series) in zip(axes, plots.items(), strict=True):
        rate = series.pop("_rate")
        ax.fill_between([t / 60 for t, _ in rate], [r / r1 for _, r in rate], color="0.88",
                        label="load (replicas' worth)", step="post")
        for label, pts in series.items():
            if label.startswith("hpa") and label != PLOTTED_HPA:
                continue  # one HPA variant keeps the plot readable; all are in the JSON
            ax.step([t / 60 for t, _ in pts], [n for _, n in pts], where="post", label=label,
                    lw=2.0 if label == "ours" else 1.2)
        ax.set_title(name, fontsize=9)
        ax.set_ylabel("replicas")
    axes[-1].set_xlabel("minutes")
    axes[0].legend(fontsize=7, ncol=3, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
