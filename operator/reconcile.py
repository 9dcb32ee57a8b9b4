"""Bring the children in line with the desired objects with server-side apply.

Each child is read once (to refuse one that another owner controls), then applied: `PATCH` with
`application/apply-patch+yaml`, field manager `decodeservice-operator`, `force=true`. The API server
creates the object if it is missing, makes a no-op of an unchanged one, takes back fields someone edited
by hand, and removes every field we applied before and no longer apply (a nodeSelector key, a volume, an
init container), which a merge patch never did. So there is no create/409/re-read dance and no diffing
here: the API server owns the merge.

Replicas in autoscaling mode `external` belong to an HPA or KEDA, which write them through the scale
subresource. The Deployment is created with the initial count; after that we hand `spec.replicas` to a
manager of its own that never applies again (`decodeservice-replicas-handover`, the pattern the
Kubernetes docs give for handing replicas to an HPA) and stop applying it. Dropping it without the
handover would make the API server remove the field and default it back to 1.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from decodeservice.operator.errors import ApiError, ChildConflictError
from decodeservice.operator.kube import FIELD_MANAGER, KINDS, KubeClient, kind_of
from decodeservice.operator.manifests import Children
from decodeservice.operator.status import _conditions, now_iso

HANDOVER_MANAGER = "decodeservice-replicas-handover"


@dataclass(frozen=True, kw_only=True)
class PoolOutcome:
    """What happened to the InferencePool: `applied` False with a reason when it could not be."""

    enabled: bool
    applied: bool
    reason: str
    message: str


POOL_CONDITION = "InferencePoolReady"


def pool_condition(pool: PoolOutcome, *, generation: int, previous: Mapping[str, Any] | None) -> dict[str, Any]:
    """`InferencePoolReady`: True once applied; False with CRDNotInstalled when the cluster lacks the CRD."""
    values = [(POOL_CONDITION, "True" if pool.applied else "False", pool.reason, pool.message)]
    return _conditions(values, generation=generation, previous=previous, now=now_iso())[0]


@dataclass(frozen=True, kw_only=True)
class Applied:
    deployment: dict[str, Any]
    inference_pool: PoolOutcome


def _controller_uid(obj: Mapping[str, Any]) -> str | None:
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if isinstance(ref, Mapping) and ref.get("controller"):
            return str(ref.get("uid"))
    return None


def owns(obj: Mapping[str, Any], manager: str, *path: str) -> bool:
    """Whether `manager` applied the field at `path` (plain keys), per the object's managedFields."""
    for entry in (obj.get("metadata") or {}).get("managedFields") or []:
        if not isinstance(entry, Mapping) or entry.get("manager") != manager or entry.get("operation") != "Apply":
            continue
        node: Any = entry.get("fieldsV1") or {}
        for key in path:
            node = node.get(f"f:{key}") if isinstance(node, Mapping) else None
        if node is not None:
            return True
    return False


async def _check_controller(client: KubeClient, desired: Mapping[str, Any], *,
                            owner_uid: str) -> dict[str, Any] | None:
    kind, meta = kind_of(desired), desired["metadata"]
    live = await client.get(kind, str(meta["namespace"]), str(meta["name"]))
    controller = _controller_uid(live) if live is not None else None
    if controller is not None and controller != owner_uid:
        raise ChildConflictError(f"{desired['kind']} {meta['namespace']}/{meta['name']} is controlled by another "
                                 f"owner (uid {controller}); rename the DecodeService or remove that object")
    return live


async def apply_child(client: KubeClient, desired: Mapping[str, Any], *, owner_uid: str) -> dict[str, Any]:
    """Apply one child; an orphan with our name is adopted (the applied ownerReference), a foreign one refused."""
    await _check_controller(client, desired, owner_uid=owner_uid)
    meta = desired["metadata"]
    return await client.apply(kind_of(desired), str(meta["namespace"]), str(meta["name"]), desired)


async def _apply_external_replicas(client: KubeClient, desired: Mapping[str, Any], *,
                                   owner_uid: str) -> dict[str, Any]:
    kind, meta = kind_of(desired), desired["metadata"]
    namespace, name = str(meta["namespace"]), str(meta["name"])
    live = await _check_controller(client, desired, owner_uid=owner_uid)
    if live is None:
        live = await client.apply(kind, namespace, name, desired)  # created with the initial replica count
    if owns(live, FIELD_MANAGER, "spec", "replicas"):
        handover = {"apiVersion": desired["apiVersion"], "kind": desired["kind"],
                    "metadata": {"name": name, "namespace": namespace},
                    "spec": {"replicas": int((live.get("spec") or {}).get("replicas") or 0)}}
        # No force: if the autoscaler changed the count since our read, the 409 retries with its value.
        await client.apply(kind, namespace, name, handover, field_manager=HANDOVER_MANAGER, force=False)
    spec = {k: v for k, v in desired["spec"].items() if k != "replicas"}
    return await client.apply(kind, namespace, name, {**desired, "spec": spec})


async def _apply_pool(client: KubeClient, children: Children, *, owner_uid: str, namespace: str,
                      name: str) -> PoolOutcome:
    kind = KINDS["InferencePool"]
    if children.inference_pool is None:
        try:
            live = await client.get(kind, namespace, name)
        except ApiError as exc:
            if exc.status not in (403, 404):
                raise
            live = None  # no CRD, or a chart from before the pool existed (no RBAC): nothing of ours there
        if live is not None and _controller_uid(live) == owner_uid:
            await client.delete(kind, namespace, name)
        return PoolOutcome(enabled=False, applied=False, reason="Disabled", message="spec.routing.inferencePool is off")
    try:
        await apply_child(client, children.inference_pool, owner_uid=owner_uid)
    except ApiError as exc:
        # Neither stops the Deployment from serving: say so in the condition and go on.
        if exc.not_found:  # the API group is not served: the Gateway API Inference Extension CRD is missing
            return PoolOutcome(enabled=True, applied=False, reason="CRDNotInstalled",
                               message="the InferencePool CRD (inference.networking.k8s.io/v1) is not installed; "
                                       "install the Gateway API Inference Extension CRDs to route through a pool")
        if exc.status == 403:
            return PoolOutcome(enabled=True, applied=False, reason="Forbidden",
                               message="the operator may not write inferencepools.inference.networking.k8s.io; "
                                       f"upgrade the chart (its RBAC grants that): {exc}")
        raise
    return PoolOutcome(enabled=True, applied=True, reason="Applied", message=f"InferencePool {name} applied")


async def apply_children(client: KubeClient, children: Children, *, owner_uid: str, namespace: str,
                         name: str) -> Applied:
    """Apply every child (ConfigMap first, so a rolled pod finds its new policy); returns the live Deployment."""
    deployment: dict[str, Any] = {}
    for obj in children.all():
        if obj is children.inference_pool:
            continue  # applied last, and only where its CRD is installed
        if obj is children.deployment and children.external_replicas:
            deployment = await _apply_external_replicas(client, obj, owner_uid=owner_uid)
            continue
        live = await apply_child(client, obj, owner_uid=owner_uid)
        if obj is children.deployment:
            deployment = live
    if children.pdb is None:
        pdb_kind = KINDS["PodDisruptionBudget"]
        live_pdb = await client.get(pdb_kind, namespace, name)
        if live_pdb is not None and _controller_uid(live_pdb) == owner_uid:
            await client.delete(pdb_kind, namespace, name)
    pool = await _apply_pool(client, children, owner_uid=owner_uid, namespace=namespace, name=name)
    return Applied(deployment=deployment, inference_pool=pool)
