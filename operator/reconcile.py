"""Bring the children in line with the desired objects, idempotently.

Get-or-create by name (never generateName), so a retried create cannot make a twin: a 409 on create means
an earlier attempt (or another worker) got there first, and we read the object back and patch it. Live
objects are compared to the desired ones as a subset (the API server adds defaults we do not set), and
only a difference is patched, so a resync of an unchanged service makes no writes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from decodeservice.operator.errors import ApiError, ChildConflictError
from decodeservice.operator.kube import KINDS, KubeClient, kind_of
from decodeservice.operator.manifests import Children


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


def _controller_uid(obj: Mapping[str, Any]) -> str | None:
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if isinstance(ref, Mapping) and ref.get("controller"):
            return str(ref.get("uid"))
    return None


async def apply_child(client: KubeClient, desired: Mapping[str, Any], *, owner_uid: str) -> dict[str, Any]:
    kind = kind_of(desired)
    meta = desired["metadata"]
    namespace, name = str(meta["namespace"]), str(meta["name"])
    live = await client.get(kind, namespace, name)
    if live is None:
        try:
            return await client.create(kind, namespace, desired)
        except ApiError as exc:
            if not exc.conflict:
                raise
        live = await client.get(kind, namespace, name)
        if live is None:  # created and deleted again between our two calls: let the retry sort it out
            raise ApiError(status=409, api_reason="Conflict", message=f"{desired['kind']} {name} vanished")
    controller = _controller_uid(live)
    if controller is not None and controller != owner_uid:
        raise ChildConflictError(f"{desired['kind']} {namespace}/{name} is controlled by another owner "
                                 f"(uid {controller}); rename the DecodeService or remove that object")
    if is_subset(desired, live):
        return live
    # Adopting an orphan and repairing drift are the same merge patch: our fields, our owner reference.
    return await client.patch(kind, namespace, name, desired)


async def apply_children(client: KubeClient, children: Children, *, owner_uid: str, namespace: str,
                         name: str) -> dict[str, Any]:
    """Apply every child (ConfigMap first, so a rolled pod finds its new policy); returns the live Deployment."""
    deployment: dict[str, Any] = {}
    for obj in children.all():
        live = await apply_child(client, obj, owner_uid=owner_uid)
        if obj is children.deployment:
            deployment = live
    if children.pdb is None:
        pdb_kind = KINDS["PodDisruptionBudget"]
        live_pdb = await client.get(pdb_kind, namespace, name)
        if live_pdb is not None and _controller_uid(live_pdb) == owner_uid:
            await client.delete(pdb_kind, namespace, name)
    return deployment
