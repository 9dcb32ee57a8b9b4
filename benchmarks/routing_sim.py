"""The router's policies at 8-64 replicas, simulated: SLO attainment, replica-minutes and cache share.

The autoscaler's queueing model (`autoscale_model.py`: continuous batching, the proxy's queues, the
SLO judgement; the operator's own `Autoscaler` resizing the fleet every 5 s, pods ready 100 s after
creation, as `autoscale_sim.py` runs it) with a prefix cache per replica (an LRU of prompt blocks, the
engine's KV capacity) and a per-token prefill cost (`routing_sim_model.py`). Three policies route the
same arrivals:

- `router`: the router's own decision code (`router/scoring.py`, its prefix index, its TTFT model);
- `round_robin`: what a Service does;
- `affinity`: rendezvous hashing of the conversation, blind to load.

Workloads: the autoscaler's trace shapes (a staged ramp, a compressed day, sudden bursts; arrivals and
request sizes from `autoscale_model.Trace`, each prompt opening with one of 16 shared system prompts)
and a multi-turn one (conversations with their own 400-800-token document, 4 turns, each sent with the
whole history after a pause). Rates are in units of one replica's sustainable rate (the rate one
replica serves at >= 95 % attainment, found per workload), scaled so each trace peaks at `--peaks`
replicas' worth.

Costs, from two measured JSONs (named in the output): the per-token prefill cost is the slope of the
engine's cache-miss TTFT over prompt lengths 512-2600 and the decode step's base is one token at short
context, both from `long_context_2600_native_cpu2_vector_softmax.json`; how the step grows per sequence in the batch
(relative to its base), the batch limit and the KV capacity from `engine_profile_cpu2.json`
(the autoscaler simulation's profile).

    .venv/bin/python -P benchmarks/routing_sim.py --out benchmarks/results/routing_sim.json
    .venv/bin/python -P benchmarks/routing_sim.py --fixed --out benchmarks/results/routing_sim_fixed.json

`--fixed` runs the policies alone, without the autoscaler's feedback: fleets of each `--peaks` size at
a constant 0.9 of their sustainable rate, both workloads, 300 s each (`--workloads`, `--policies`: a
subset, for one slow case, e.g. `--fixed --peaks 64 --workloads multi --policies router`).

Not fast at 64 replicas: on the shared 2-core machine (load ~8) `--peaks 8` took 3.5 minutes,
`--fixed` (8 and 64) 6 minutes, and the default's 64-replica peak did not finish in 25 minutes.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

sys.path.insert(0, str(Path(__file__).parent))  # `python -P` leaves the script's folder off the path
from autoscale_model import CLASSES, EngineProfile, Outcomes, Trace, bursts, constant, day, staged
from autoscale_sim import OBJECTIVES, Ours, ours_settings
from routing_sim_model import (
    Affinity,
    CachedReplica,
    Costs,
    RoundRobin,
    RouterPolicy,
    Turn,
    Workload,
    percentile_of,
    shed_miss,
)

from decodeservice.operator.autoscaler.types import FleetObservation

RESULTS = Path(__file__).parent / "results"
POLICIES = ("router", "round_robin", "affinity")
Scaler = Callable[[FleetObservation], int]


class Policy(Protocol):
    name: str

    def pick(self, turn: Turn, ready: list[CachedReplica], now: float) -> CachedReplica | None: ...


def load_costs(long_context: Path, profile: Path) -> Costs:
    doc = json.loads(long_context.read_text())
    pts = sorted((int(n), c["engine"]["miss"]["ttft_s"]) for n, c in doc["contexts"].items())
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    per_token = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
    base = 1 / doc["engine_short_context_decode_tokens_per_s"]
    shape = EngineProfile.load(profile)
    return Costs(base_s=base, per_seq_s=base * shape.per_seq_s / shape.base_s, per_token_s=per_token,
                 max_num_seqs=shape.max_num_seqs, kv_capacity_tokens=shape.kv_capacity_tokens)


def simulate(workload: Workload, policy: Policy, *, costs: Costs, scaler: Scaler, initial: int, seed: int,
             interval: float = 5.0, warmup: float = 100.0) -> dict[str, Any]:
    """Replay the workload through a fleet that `scaler` resizes and `policy` routes into."""
    outcomes = Outcomes()
    horizon = workload.trace.duration_s
    events: list[tuple[float, int, int, Any]] = []  # (time, kind: 0 step end, 1 arrival, 2 tick; seq, payload)
    seq = itertools.count()
    turns: list[Turn] = []
    pods: list[CachedReplica] = []
    gone: list[CachedReplica] = []
    retired: list[tuple[float, float]] = []
    serial = itertools.count(1)

    def push(turn: Turn) -> None:
        if turn.arrival <= horizon:  # the trace's end cuts the conversations still going
            turns.append(turn)
            heapq.heappush(events, (turn.arrival, 1, next(seq), turn))

    def schedule(end: float | None, pod: CachedReplica) -> None:
        if end is not None:
            heapq.heappush(events, (end, 0, next(seq), pod))

    def new_pod(now: float, ready_at: float) -> None:
        pods.append(CachedReplica(f"pod-{next(serial)}", costs=costs, created=now, ready_at=ready_at,
                                  objectives=OBJECTIVES, outcomes=outcomes))

    def remove(pod: CachedReplica, now: float) -> None:
        pods.remove(pod)
        gone.append(pod)
        retired.append((pod.created, now))
        if isinstance(policy, RouterPolicy):
            policy.forget(pod.name)

    for _ in range(initial):
        new_pod(0.0, 0.0)
    workload.start(seed, push)
    heapq.heappush(events, (interval, 2, next(seq), None))
    sizes = [initial]
    while events:
        now, kind, _, payload = heapq.heappop(events)
        if kind == 0:
            pod = payload
            schedule(pod.step_end(now), pod)
            if pod.draining and pod.load == 0 and pod.busy_until is None:
                remove(pod, now)
        elif kind == 1:
            live = [p for p in pods if not p.draining]
            ready = [p for p in live if p.ready_at <= now] or live
            pod = policy.pick(payload, ready, now)
            if pod is None:
                shed_miss(outcomes, payload)
            else:
                schedule(pod.add(payload, now), pod)
        elif now <= horizon:
            live = [p for p in pods if not p.draining]
            ready = [p for p in live if p.ready_at <= now]
            desired = scaler(FleetObservation(at=now, current_replicas=len(live), samples=[p.sample(now) for p in ready],
                                              starting_pods=len(live) - len(ready)))
            for _ in range(desired - len(live)):
                new_pod(now, now + warmup)
            # Like a ReplicaSet: pods not ready go first, then the newest.
            for p in sorted(live, key=lambda p: (p.ready_at <= now, -p.created))[: max(len(live) - desired, 0)]:
                p.draining = True
                if p.load == 0 and p.busy_until is None:
                    remove(p, now)
            sizes.append(desired)
            heapq.heappush(events, (now + interval, 2, next(seq), None))
    life = [(p.created, horizon) for p in pods] + retired
    everyone = pods + gone
    prompt = sum(p.prompt_tokens for p in everyone)
    ttfts = [t.first_token_at - t.arrival for t in turns if not math.isnan(t.first_token_at)]
    total = sum(outcomes.total.values())
    return {"attainment": round(sum(outcomes.met.values()) / max(total, 1), 4),
            "by_class": {c: round(outcomes.met[c] / max(outcomes.total[c], 1), 4) for c in CLASSES},
            "replica_minutes": round(sum(max(min(e, horizon) - s, 0.0) for s, e in life) / 60, 1),
            "max_replicas": max(sizes), "requests": len(turns),
            "cached_share": round(sum(p.cached_tokens for p in everyone) / prompt, 4) if prompt else None,
            "shed_by_router": getattr(policy, "shed", 0),
            "ttft_p50_s": _round(percentile_of(ttfts, 50)), "ttft_p95_s": _round(percentile_of(ttfts, 95))}


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def make_policy(name: str, costs: Costs) -> Policy:
    if name == "router":
        return RouterPolicy(objective_s=OBJECTIVES["interactive"].ttft_s, max_blocks=costs.kv_capacity_tokens // 16)
    return RoundRobin() if name == "round_robin" else Affinity()


def sustainable_rate(make: Callable[[float], Workload], costs: Costs, *, seed: int) -> float:
    """Highest rate one replica serves at >= 95 % attainment (bisection; one replica: no routing)."""
    lo, hi = 0.02, 20.0
    for _ in range(9):
        mid = math.sqrt(lo * hi)
        r = simulate(make(mid), RoundRobin(), costs=costs, scaler=lambda o: 1, initial=1, seed=seed)
        lo, hi = (mid, hi) if r["attainment"] >= 0.95 else (lo, mid)
    return lo


def shapes(peak: float, short: bool) -> list[Trace]:
    """The autoscaler's trace shapes, peaking at `peak` requests/s, compressed in time (`short`: the test's)."""
    s = 0.1 if short else 1.0
    levels = [x / 8 * peak for x in (1, 2, 4, 6, 8, 6, 4, 2, 1)]
    return [staged(levels, 100.0 * s),
            day(0.1 * peak, peak, 1000.0 * s),
            bursts(2 / 7 * peak, peak, [250.0 * s, 650.0 * s], 120.0 * s, 1000.0 * s)]


def study(args: argparse.Namespace) -> dict[str, Any]:
    costs = load_costs(args.long_context, args.profile)
    single = lambda trace: Workload(trace=trace)  # noqa: E731
    multi = lambda trace: Workload(trace=trace, turns=args.turns)  # noqa: E731
    r1 = {"single": sustainable_rate(lambda r: single(constant(r, 300.0)), costs, seed=args.seed),
          "multi": sustainable_rate(lambda r: multi(constant(r, 300.0)), costs, seed=args.seed)}
    report: dict[str, Any] = {
        "study": "routing_sim", "command": "benchmarks/routing_sim.py " + " ".join(args.argv),
        "costs": vars(costs) | {"sources": [str(args.long_context.name), str(args.profile.name)]},
        "objectives": {c: vars(o) for c, o in OBJECTIVES.items()},
        "router_objective_s": OBJECTIVES["interactive"].ttft_s,
        "replica_rate_at_95pct": {k: round(v, 4) for k, v in r1.items()}, "runs": []}
    if args.fixed:
        return report | {"runs": fixed_fleets(args, costs, r1, single, multi)}
    for peak_n in args.peaks:
        workloads = [single(t) for t in shapes(peak_n * r1["single"], args.short)]
        if peak_n > args.all_shapes_up_to:  # the ramp alone: a large fleet's minutes take a while to simulate
            workloads = workloads[:1]
        workloads.append(multi(shapes(peak_n * r1["multi"], args.short)[0]))
        for workload in workloads:
            start_n = max(1, math.ceil(workload.trace.rate(0.0) / r1["multi" if workload.turns > 1 else "single"]))
            entry: dict[str, Any] = {"peak_replicas_worth": peak_n, "workload": workload.name,
                                     "duration_s": workload.trace.duration_s, "policies": {}}
            for name in POLICIES:
                started = time.perf_counter()
                scaler = Ours(ours_settings(1, 2 * peak_n, args.target_inflight))
                result = simulate(workload, make_policy(name, costs), costs=costs, scaler=scaler, initial=start_n,
                                  seed=args.seed)
                entry["policies"][name] = result | {"sim_wall_s": round(time.perf_counter() - started, 2)}
            rr = entry["policies"]["round_robin"]
            entry["router_vs_round_robin"] = {
                "attainment_delta": round(entry["policies"]["router"]["attainment"] - rr["attainment"], 4),
                "replica_minutes_ratio": round(entry["policies"]["router"]["replica_minutes"] / rr["replica_minutes"], 3)}
            report["runs"].append(entry)
            print(json.dumps({k: v for k, v in entry.items() if k != "policies"} | {
                n: (p["attainment"], p["replica_minutes"], p["cached_share"]) for n, p in entry["policies"].items()}),
                flush=True)
    return report


def fixed_fleets(args: argparse.Namespace, costs: Costs, r1: dict[str, float],
                 single: Callable[[Trace], Workload], multi: Callable[[Trace], Workload]) -> list[dict[str, Any]]:
    """The policies alone, without the autoscaler's feedback: `peak` replicas at a constant
    `--fixed-load` of their sustainable rate."""
    runs = []
    for peak_n in args.peaks:
        for kind, make in (("single", single), ("multi", multi)):
            if kind not in args.workloads:
                continue
            workload = make(constant(args.fixed_load * peak_n * r1[kind], 60.0 if args.short else 300.0))
            entry: dict[str, Any] = {"replicas": peak_n, "workload": workload.name, "load": args.fixed_load,
                                     "policies": {}}
            for name in args.policies:
                entry["policies"][name] = simulate(workload, make_policy(name, costs), costs=costs,
                                                   scaler=lambda o, n=peak_n: n, initial=peak_n, seed=args.seed)
            runs.append(entry)
            print(json.dumps({k: v for k, v in entry.items() if k != "policies"} | {
                n: (p["attainment"], p["cached_share"], p["ttft_p95_s"]) for n, p in entry["policies"].items()}),
                flush=True)
    return runs


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--long-context", type=Path, default=RESULTS / "long_context_2600_native_cpu2_vector_softmax.json")
    ap.add_argument("--profile", type=Path, default=RESULTS / "engine_profile_cpu2.json")
    ap.add_argument("--peaks", type=lambda s: [int(x) for x in s.split(",")], default=[8, 64],
                    help="replicas' worth of load at each trace's peak")
    ap.add_argument("--all-shapes-up-to", type=int, default=16,
                    help="larger peaks run the staged ramp and the multi-turn workload only")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--target-inflight", type=int, default=16, help="the autoscaler's targetInflightPerReplica")
    ap.add_argument("--short", action="store_true", help="traces a tenth as long (the test's)")
    ap.add_argument("--fixed", action="store_true",
                    help="instead: fixed fleets of each --peaks size at a constant --fixed-load, no autoscaler")
    ap.add_argument("--fixed-load", type=float, default=0.9, help="with --fixed: the share of the fleet's rate")
    ap.add_argument("--workloads", type=lambda s: s.split(","), default=["single", "multi"],
                    help="with --fixed: which workloads (single, multi)")
    ap.add_argument("--policies", type=lambda s: s.split(","), default=list(POLICIES),
                    help="with --fixed: which policies (a subset of the default)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if not set(args.policies) <= set(POLICIES) or not set(args.workloads) <= {"single", "multi"}:
        ap.error(f"--policies: a subset of {','.join(POLICIES)}; --workloads: a subset of single,multi")
    args.argv = list(argv) if argv is not None else sys.argv[1:]
    report = study(args)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
