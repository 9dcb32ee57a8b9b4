"""Bring the children in line with the desired objects with server-side apply.

Each child is read once (to refuse one that another owner controls), then applied: `PATCH` with
`application/apply-patch+yaml`, field manager `decodeservice-operator`, `force=true`. The API server
creates the object if it is missing, makes a no-op of an unchanged one, takes back fields someone edited
by hand, and removes every field we applied before and no longer apply (a nodeSelector key, a volume, an
init container), which a merge patch never did. So there is no create/409/re-read dance and no diffing
here: the API server owns the merge.

Children written by the merge-patch versions of this operator are upgraded once (`upgraded_managed_fields`)
so their leftover fields are removed too.

An apply that would change nothing is not sent: each applied body carries the hash of itself in the
`decode.dev/applied-hash` annotation, and a child whose hash matches and whose fields still hold our
values (nobody edited them) is left alone. So a resync of an unchanged DecodeService makes no writes; a
changed spec changes the hash, and that apply removes what we no longer set.

Replicas are always ours to apply (`manifests.desired_replicas`). In autoscaling mode `external` an HPA
or KEDA scales the DecodeService through its scale subresource (`spec.replicas`), never the Deployment
(or LeaderWorkerSet), so the two never fight over the workload's `spec.replicas`.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from decodeservice.operator.errors import ApiError, ChildConflictError, WorkloadUnavailableError
from decodeservice.operator.kube import FIELD_MANAGER, KINDS, KubeClient, kind_of
from decodeservice.operator.manifests import Children
from decodeservice.operator.router import pods_service_name, router_name
from decodeservice.operator.status import _conditions, now_iso

APPLIED_HASH = "decode.dev/applied-hash"
POOL_CONDITION = "InferencePoolReady"


@dataclass(frozen=True, kw_only=True)
class PoolOutcome:
    """What happened to the InferencePool: `applied` False with a reason when it could not be."""

    enabled: bool
    applied: bool
    reason: str
    message: str

    def condition(self, *, generation: int, previous: Mapping[str, Any] | None) -> dict[str, Any]:
        """`InferencePoolReady`: True once applied; False with CRDNotInstalled when the cluster lacks the CRD."""
        values = [(POOL_CONDITION, "True" if self.applied else "False", self.reason, self.message)]
        return _conditions(values, generation=generation, previous=previous, now=now_iso())[0]


@dataclass(frozen=True, kw_only=True)
class Applied:
    workload: dict[str, Any]  # the live Deployment or LeaderWorkerSet
    inference_pool: PoolOutcome


def _controller_uid(obj: Mapping[str, Any]) -> str | None:
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if isinstance(ref, Mapping) and ref.get("controller"):
            return str(ref.get("uid"))
    return None


def is_subset(desired: Any, live: Any) -> bool:
    """True when every field we set has the value we want; lists must match item by item."""
    if isinstance(desired, Mapping):
        return isinstance(live, Mapping) and all(k in live and is_subset(v, live[k]) for k, v in desired.items())
    if isinstance(desired, list):
        return (isinstance(live, list) and len(desired) == len(live)
                and all(is_subset(d, x) for d, x in zip(desired, live, strict=True)))
    if isinstance(desired, bool) or isinstance(live, bool):
        return desired is live
    if isinstance(desired, int | float) and isinstance(live, int | float):
        return float(desired) == float(live)
    return bool(desired == live)


def with_applied_hash(desired: Mapping[str, Any]) -> dict[str, Any]:
    """The body to apply: `desired` plus the hash of `desired` in an annotation."""
    body = copy.deepcopy(dict(desired))
    digest = hashlib.sha256(json.dumps(desired, sort_keys=True).encode()).hexdigest()[:16]
    body["metadata"].setdefault("annotations", {})[APPLIED_HASH] = digest
    return body


async def _check_controller(client: KubeClient, desired: Mapping[str, Any], *,
                            owner_uid: str) -> dict[str, Any] | None:
    kind, meta = kind_of(desired), desired["metadata"]
    live = await client.get(kind, str(meta["namespace"]), str(meta["name"]))
    controller = _controller_uid(live) if live is not None else None
    if controller is not None and controller != owner_uid:
        raise ChildConflictError(f"{desired['kind']} {meta['namespace']}/{meta['name']} is controlled by another "
                                 f"owner (uid {controller}); rename the DecodeService or remove that object")
    return live


def upgraded_managed_fields(live: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """managedFields with our merge-patch era ownership turned into apply ownership; None when not needed.

    Before server-side apply this operator merge-patched its children, so the API server recorded its
    fields under (decodeservice-operator, Update). Apply only removes fields the applier owns, so a field
    from that era that we no longer set would stay forever. This is what kubectl's csaupgrade does: the
    Update entry becomes our Apply entry, and the next apply removes what we no longer set.
    """
    entries = [e for e in (live.get("metadata") or {}).get("managedFields") or [] if isinstance(e, Mapping)]
    ours = [e for e in entries if e.get("manager") == FIELD_MANAGER and not e.get("subresource")]
    if any(e.get("operation") == "Apply" for e in ours) or not any(e.get("operation") == "Update" for e in ours):
        return None
    return [{**e, "operation": "Apply"} if e in ours else dict(e) for e in entries]


async def _upgrade_ownership(client: KubeClient, live: Mapping[str, Any]) -> None:
    upgraded = upgraded_managed_fields(live)
    if upgraded is None:
        return
    meta = live["metadata"]
    await client.json_patch(kind_of(live), str(meta["namespace"]), str(meta["name"]), [
        {"op": "test", "path": "/metadata/resourceVersion", "value": meta.get("resourceVersion")},
        {"op": "replace", "path": "/metadata/managedFields", "value": upgraded}])


async def apply_child(client: KubeClient, desired: Mapping[str, Any], *, owner_uid: str) -> dict[str, Any]:
    """Apply one child; an orphan with our name is adopted (the applied ownerReference), a foreign one refused."""
    live = await _check_controller(client, desired, owner_uid=owner_uid)
    if live is not None and _controller_uid(live) == owner_uid:
        await _upgrade_ownership(client, live)
    body = with_applied_hash(desired)
    if live is not None and is_subset(body, live):
        return live  # same hash: nothing to remove; every value still ours: nothing to set
    meta = desired["metadata"]
    return await client.apply(kind_of(desired), str(meta["namespace"]), str(meta["name"]), body)


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
        return PoolOutcome(enabled=False, applied=False, reason="Disabled", message="spec.routing.mode is not inferencePool")
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


LWS_API = "leaderworkersets.leaderworkerset.x-k8s.io"
# Deleted in this order; the ServiceAccount, applied first and deleted last, says whether any is left.
ROUTER_CHILDREN = (("Deployment", router_name), ("PodDisruptionBudget", router_name), ("Service", pods_service_name),
                   ("RoleBinding", router_name), ("Role", router_name), ("ServiceAccount", router_name))


async def _delete_router(client: KubeClient, namespace: str, name: str, *, owner_uid: str) -> None:
    """The router's children, once routing left mode router; one read when there are none (the common case)."""
    try:
        account = await client.get(KINDS["ServiceAccount"], namespace, router_name(name))
    except ApiError as exc:
        if exc.status not in (403, 404):
            raise
        return  # a chart from before the router (no RBAC for ServiceAccounts): it never made one
    if account is None or _controller_uid(account) != owner_uid:
        return
    for kind, child in ROUTER_CHILDREN:
        await _delete_ours(client, kind, namespace, child(name), owner_uid=owner_uid)


async def _delete_ours(client: KubeClient, kind_name: str, namespace: str, name: str, *, owner_uid: str) -> None:
    """Delete a child we no longer render, if it is ours; one we may not read (a chart from before its
    kind was ours to write) is taken as absent."""
    kind = KINDS[kind_name]
    try:
        live = await client.get(kind, namespace, name)
    except ApiError as exc:
        if exc.status not in (403, 404):
            raise
        return
    if live is not None and _controller_uid(live) == owner_uid:
        await client.delete(kind, namespace, name)


async def _apply_workload(client: KubeClient, children: Children, *, owner_uid: str, namespace: str,
                          name: str) -> dict[str, Any]:
    """Apply the Deployment or the LeaderWorkerSet, then delete our own object of the other kind (the
    service switched between one node and several). A LeaderWorkerSet the cluster cannot take raises
    WorkloadUnavailableError before anything else changed, so a Deployment that served keeps serving."""
    workload = children.workload
    try:
        live = await apply_child(client, workload, owner_uid=owner_uid)
    except ApiError as exc:
        if workload["kind"] != "LeaderWorkerSet" or exc.status not in (403, 404):
            raise
        if exc.not_found:  # the API group is not served: the LWS CRD (and controller) is not installed
            raise WorkloadUnavailableError(
                f"resources.nodes > 1 runs each replica as a LeaderWorkerSet, and this cluster does not serve "
                f"{LWS_API} (v1): install LeaderWorkerSet (https://lws.sigs.k8s.io/docs/installation/); until "
                "then nothing is rolled and an existing Deployment keeps serving", reason="LWSNotInstalled") from exc
        raise WorkloadUnavailableError(
            f"the operator may not write {LWS_API}; upgrade the chart (its RBAC grants that): {exc}",
            reason="LWSForbidden") from exc
    other = KINDS["Deployment" if workload["kind"] == "LeaderWorkerSet" else "LeaderWorkerSet"]
    try:
        stale = await client.get(other, namespace, name)
    except ApiError as exc:
        if exc.status not in (403, 404):
            raise
        stale = None  # no LWS API, or a chart from before multi-node (no RBAC for it): nothing of ours there
    if stale is not None and _controller_uid(stale) == owner_uid:
        await client.delete(other, namespace, name)
    return live


async def apply_children(client: KubeClient, children: Children, *, owner_uid: str, namespace: str,
                         name: str) -> Applied:
    """Apply every child and return the live workload. The ConfigMap goes first, so a rolled pod finds its
    new policy; the workload next, so that the Service selects its pods only once they can exist."""
    await apply_child(client, children.config_map, owner_uid=owner_uid)
    workload = await _apply_workload(client, children, owner_uid=owner_uid, namespace=namespace, name=name)
    # The Service last of these: when routing turns on, it selects the routers only once they exist.
    later = (children.config_map, children.workload, children.inference_pool, children.service)
    routing = children.router.all() if children.router is not None else []
    for obj in routing:
        try:
            await apply_child(client, obj, owner_uid=owner_uid)
        except ApiError as exc:
            if exc.status != 403:
                raise
            # A chart from before the router: the Service is not switched, so the pods keep serving.
            raise WorkloadUnavailableError(
                f"routing mode router needs the operator to write serviceaccounts, roles and rolebindings and to "
                f"read endpointslices; upgrade the chart (its RBAC grants that): {exc}", reason="RouterForbidden",
                progress="waiting for the operator's RBAC to cover the router") from exc
    for obj in children.all():
        if any(obj is o for o in later) or any(obj is o for o in routing):
            continue  # applied above; the pool last, and only where its CRD is installed
        await apply_child(client, obj, owner_uid=owner_uid)
    await apply_child(client, children.service, owner_uid=owner_uid)
    if children.pdb is None:
        await _delete_ours(client, "PodDisruptionBudget", namespace, name, owner_uid=owner_uid)
    if children.router is None:  # routing left mode router: its children go, the Service already points away
        await _delete_router(client, namespace, name, owner_uid=owner_uid)
    pool = await _apply_pool(client, children, owner_uid=owner_uid, namespace=namespace, name=name)
    return Applied(workload=workload, inference_pool=pool)
