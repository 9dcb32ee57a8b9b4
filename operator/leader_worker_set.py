"""A multi-node replica (spec.resources.nodes > 1, vLLM only) as a LeaderWorkerSet: pure functions, dicts out.

LeaderWorkerSet (`leaderworkerset.x-k8s.io/v1`, kubernetes-sigs/lws) runs `replicas` groups of `size`
pods: one leader and size - 1 workers, created, restarted and rolled out together. The operator renders
one LWS in place of the Deployment, with the contract of LWS's own API types (api/leaderworkerset/v1):

- spec.replicas: the DecodeService's replicas, counted in groups (the builtin autoscaler writes it as it
  writes a Deployment's); leaderWorkerTemplate.size: spec.resources.nodes.
- the leader template: the same pod as a single-node replica (init container, proxy sidecar, the policy
  ConfigMap, probes), its engine container starting the Ray head before vLLM (engines.RAY_LEADER_SCRIPT);
  the worker template: the engine container alone, joining that head (engines.RAY_WORKER_SCRIPT), with the
  same model volumes (every pod loads its own shard from the same path).
- pods carry ROLE_LABEL (leader or worker) beside the service's selector labels. The Service, the
  InferencePool, status.selector (HPA) and the autoscaler's scrape select leaders only: workers serve no
  HTTP. The PDB keeps all the service's pods, so a drain takes at most one pod (one group) at a time.
- restartPolicy RecreateGroupOnPodRestart: a group whose pod restarted has lost its Ray cluster.
- networkConfig.subdomainPolicy UniquePerReplica: with the default (Shared) the LWS controller makes a
  headless Service named after the LWS, unless a Service of that name exists, and ours does (the
  DecodeService's own Service), so LWS_LEADER_ADDRESS would not resolve. Per replica, the headless
  Services are named after the leader pods (NAME-0, NAME-1, ...).
- rolloutStrategy: spec.rollout, counted in groups (a surge of 1 is one more group of nodes x gpus GPUs).
"""

from __future__ import annotations

import copy
from typing import Any

from decodeservice.operator.engines import ray_worker_command
from decodeservice.operator.errors import InvalidSpecError
from decodeservice.operator.spec import ValidatedSpec

API_VERSION = "leaderworkerset.x-k8s.io/v1"
KIND = "LeaderWorkerSet"
ROLE_LABEL = "decode.dev/role"
LEADER, WORKER = "leader", "worker"
# Set by the LWS controller on every pod of a group (LWS api/leaderworkerset/v1 WorkerIndexLabelKey); the
# leader is worker 0. Ours (ROLE_LABEL) is in the templates, so a selector need not wait for the controller.
WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
# The workers' StatefulSet of group i is named NAME-i, and a StatefulSet's pods carry the label
# controller-revision-hash=STS-HASH (at most 63 characters, the hash taking 11): NAME-9999 fits in 52.
MAX_NAME = 52 - len("-9999")


def multi_node(v: ValidatedSpec) -> bool:
    return v.spec.resources.nodes > 1


def check_name(name: str) -> None:
    if len(name) > MAX_NAME:
        raise InvalidSpecError(f"metadata.name: {name!r} is too long for a multi-node service (at most {MAX_NAME} "
                               "characters: the LeaderWorkerSet names each group's StatefulSet NAME-INDEX)")


def worker_pod_spec(leader: dict[str, Any], engine: dict[str, Any]) -> dict[str, Any]:
    """A worker's pod spec from the leader's: its engine container joins Ray instead of serving, and the
    proxy (with its policy volume) stays on the leader."""
    spec = copy.deepcopy(leader)
    command, args = ray_worker_command()
    worker = {k: copy.deepcopy(v) for k, v in engine.items()
              if k not in ("ports", "startupProbe", "readinessProbe", "livenessProbe", "lifecycle")}
    worker.update(command=command, args=args)
    spec["containers"] = [worker]
    spec["volumes"] = [vol for vol in spec["volumes"] if "configMap" not in vol]
    return spec


def build_leader_worker_set(*, name: str, namespace: str, v: ValidatedSpec, labels: dict[str, str],
                            replicas: int, leader: dict[str, Any], worker: dict[str, Any]) -> dict[str, Any]:
    """`leader` and `worker` are pod templates (metadata + spec); ROLE_LABEL is added to each here."""
    check_name(name)
    rollout = v.spec.rollout
    templates = {}
    for role, template in ((LEADER, leader), (WORKER, worker)):
        t = copy.deepcopy(template)
        t["metadata"]["labels"][ROLE_LABEL] = role
        templates[role] = t
    return {
        "apiVersion": API_VERSION, "kind": KIND,
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels)},
        "spec": {
            "replicas": replicas,
            "startupPolicy": "LeaderCreated",  # workers start with the leader: each retries until its head is up
            "rolloutStrategy": {"type": "RollingUpdate", "rollingUpdateConfiguration": {
                "maxSurge": rollout.max_surge, "maxUnavailable": rollout.max_unavailable}},
            "networkConfig": {"subdomainPolicy": "UniquePerReplica"},
            "leaderWorkerTemplate": {
                "size": v.spec.resources.nodes,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": templates[LEADER],
                "workerTemplate": templates[WORKER],
            },
        },
    }
