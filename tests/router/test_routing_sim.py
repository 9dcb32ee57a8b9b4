"""benchmarks/routing_sim.py on a tiny trace: it runs every policy through the queueing model, and the
router's own decision code keeps about as much of the prompt cached as pure affinity does."""

from __future__ import annotations

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_the_router_policy_keeps_prefixes_cached_in_the_simulated_fleet() -> None:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        from autoscale_model import constant
        from routing_sim import POLICIES, RESULTS, load_costs, make_policy, simulate
        from routing_sim_model import Workload
    finally:
        sys.path.remove(str(BENCHMARKS))
    costs = load_costs(RESULTS / "long_context_2600_native_cpu2_vector_softmax.json", RESULTS / "engine_profile_cpu2.json")
    assert 0 < costs.per_token_s < costs.base_s  # a prompt token costs less than a decode step
    workload = Workload(trace=constant(1.0, 120.0), turns=4, think_s=2.0)
    runs = {name: simulate(workload, make_policy(name, costs), costs=costs, scaler=lambda o: 4, initial=4, seed=3)
            for name in POLICIES}
    for run in runs.values():
        assert run["requests"] > 200 and 0.0 <= run["attainment"] <= 1.0 and run["replica_minutes"] == 8.0
    assert runs["router"]["cached_share"] >= 0.9 * runs["affinity"]["cached_share"]
    # Four replicas: round-robin finds a conversation's earlier turns on its replica a quarter of the time.
    assert runs["round_robin"]["cached_share"] < runs["affinity"]["cached_share"]
