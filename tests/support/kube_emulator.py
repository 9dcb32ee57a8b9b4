"""An in-process Kubernetes API server for the operator's tests and benchmarks: kmock's emulator plus
what a real API server adds.

kmock stores objects exactly as posted. A real API server also assigns uid and resourceVersion on
create, sets generation to 1 and bumps it on every spec change; `ApiServer` adds exactly that, so the
operator's observedGeneration and owner references are exercised as they would be on a cluster. It also
serves server-side apply (`PATCH` with `application/apply-patch+yaml`) and keeps `managedFields` on every
write, as `server_side_apply` models them (that module says what it leaves out).
Needs kmock (the `test` extra); nothing in the product imports this module.
"""

from __future__ import annotations

import copy
import itertools
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import kmock
import yaml
from kmock import KubernetesEmulator, KubernetesError, ResourceInfo, action, resource
from kmock._internal import parsing as _kmock_parsing

from tests.support import server_side_apply as ssa

DS = "decode.dev/v1alpha1/decodeservices"
DEPLOYMENTS = "apps/v1/deployments"
SERVICES = "v1/services"
CONFIGMAPS = "v1/configmaps"
PDBS = "policy/v1/poddisruptionbudgets"
LWS = "leaderworkerset.x-k8s.io/v1/leaderworkersets"
PODS = "v1/pods"
EVENTS = "v1/events"
SERVICE_ACCOUNTS = "v1/serviceaccounts"
ROLES = "rbac.authorization.k8s.io/v1/roles"
ROLE_BINDINGS = "rbac.authorization.k8s.io/v1/rolebindings"
VERBS = {"list", "watch", "get", "create", "patch", "update", "delete"}


def merge(base: Any, patch: Any) -> Any:
    """RFC 7386 merge patch, as the API server applies `application/merge-patch+json`."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    result = dict(base) if isinstance(base, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge(result.get(key), value)
    return result


_kmock_parse_path = _kmock_parsing.parse_path


def _parse_path(path: str) -> _kmock_parsing.ParsedPath:
    """kmock's path parser, except that it reads `/api/v1/namespaces[/NAME]` as the Namespace resource.

    kmock takes the `namespaces/` prefix for a namespaced path and fails on these two paths, which a
    namespaced kopf operator lists, watches and fetches; a real API server serves them.
    """
    parts = path.split("?", 1)[0].strip("/").split("/")
    if parts[:3] == ["api", "v1", "namespaces"] and len(parts) <= 4:
        return _kmock_parsing.ParsedPath(group="", version="v1", plural="namespaces",
                                         name=parts[3] if len(parts) == 4 else None)
    return _kmock_parse_path(path)


_kmock_parsing.parse_path = _parse_path


class ApiServer(KubernetesEmulator):
    """KubernetesEmulator plus the metadata a real API server maintains (uid, generation, resourceVersion)."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._versions = itertools.count(1)
        self._rejections: list[tuple[action, kmock.resource, int]] = []

    def reject_next(self, verb: action, res: str, status: int) -> None:
        """Answer the next such request with `status` before anything is written (kmock's own reactions
        answer after the emulator stored the write, which models a lost response instead)."""
        self._rejections.append((verb, resource(res), status))

    def clear_rejections(self) -> None:
        """Forget the rejections not yet used: the requests go through again."""
        self._rejections.clear()

    async def _handle(self, request: kmock.Request) -> Any:
        for rejection in self._rejections:
            verb, res, status = rejection
            if request.action == verb and request.resource == res and request.subresource is None:
                self._rejections.remove(rejection)
                raise KubernetesError(status=status, reason="Injected", message=f"injected {status}")
        if (request.method == "PATCH" and request.resource is not None and request.subresource is None
                and request.headers.get("Content-Type", "").startswith(APPLY_PATCH)):
            await self._apply(request)
            # State is written; kmock's scaffold runs the reactions and serves the stored object.
            return await super(KubernetesEmulator, self)._handle(request)
        data = request.data
        if request.resource is not None and isinstance(data, dict):
            meta = data.setdefault("metadata", {})
            if request.action == action.CREATE:
                meta.setdefault("uid", str(uuid.uuid4()))
                meta.setdefault("generation", 1)
                meta.setdefault("creationTimestamp", datetime.now(tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
                if request.namespace and "namespace" not in meta:
                    meta["namespace"] = request.namespace
                meta["managedFields"] = ssa.record_update(None, data, manager=_manager(request))
            elif request.action == action.UPDATE and request.name is not None:
                key = (request.resource, request.namespace, request.name)
                if key in self.objects and not self.objects[key].deleted:
                    live = self.objects[key].raw
                    new_spec = merge(live.get("spec"), data["spec"]) if "spec" in data else live.get("spec")
                    if request.subresource is None and new_spec != live.get("spec"):
                        meta["generation"] = int(live.get("metadata", {}).get("generation", 1)) + 1
                    meta["managedFields"] = ssa.record_update(live, merge(live, data), manager=_manager(request))
            meta["resourceVersion"] = str(next(self._versions))
        return await super()._handle(request)


    async def _apply(self, request: kmock.Request) -> None:
        """Server-side apply: create or update the object as `server_side_apply.apply` computes it."""
        config = request.data if isinstance(request.data, dict) else yaml.safe_load(request.text)
        manager = request.params.get("fieldManager")
        if not isinstance(config, dict) or not manager:
            raise KubernetesError(status=400, reason="BadRequest",
                                  message="an apply patch needs a YAML object body and a fieldManager")
        if request.resource is None or request.name is None:
            raise KubernetesError(status=405, reason="MethodNotAllowed", message="apply needs an object's path")
        if not any(r == request.resource for r in super(KubernetesEmulator, self)._get_resources()):
            # As a real API server answers for an API group nobody installed (a missing CRD).
            raise KubernetesError(status=404, reason="NotFound", message="the server could not find the requested resource")
        key = (request.resource, request.namespace, request.name)
        async with self._lock:
            stored = self._objects[key] if key in self._objects and not self._objects[key].deleted else None
            live = copy.deepcopy(stored.raw) if stored is not None else None
            try:
                new = ssa.apply(live, config, manager=manager, force=request.params.get("force") == "true")
            except ssa.ApplyConflict as exc:
                raise KubernetesError(status=409, reason="Conflict", message=str(exc)) from None
            meta = new["metadata"]
            if live is None:
                meta.update(uid=str(uuid.uuid4()), generation=1, namespace=request.namespace,
                            creationTimestamp=datetime.now(tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
                event = "ADDED"
            elif _without_times(new) == _without_times(live):
                return  # a no-op apply writes nothing, as on a real API server
            else:
                event = "MODIFIED"
                if new.get("spec") != live.get("spec"):
                    meta["generation"] = int(live["metadata"].get("generation", 1)) + 1
            meta["resourceVersion"] = str(next(self._versions))
            if key in self._objects:
                self._objects[key].create(new)  # a new version of the history (create() appends one)
            else:
                self._objects[key] = new
            await self._buses[request.resource].put({"type": event, "object": self._objects[key].raw})


APPLY_PATCH = "application/apply-patch+yaml"


def _manager(request: kmock.Request) -> str:
    # As the API server names an Update's manager: the fieldManager parameter, else the user agent's product.
    agent = request.headers.get("User-Agent", "unknown")
    return request.params.get("fieldManager") or agent.split("/", 1)[0].strip() or "unknown"


def _without_times(obj: Mapping[str, Any]) -> Any:
    meta = dict(obj.get("metadata") or {})
    meta["managedFields"] = [{k: v for k, v in e.items() if k != "time"} for e in meta.get("managedFields") or []]
    return {**obj, "metadata": meta}


def declare_resources(server: KubernetesEmulator) -> None:
    server.resources[DS] = ResourceInfo(kind="DecodeService", singular="decodeservice", namespaced=True,
                                        verbs=VERBS, shortnames={"dsvc"}, subresources={"status", "scale"})
    server.resources[DEPLOYMENTS] = ResourceInfo(kind="Deployment", namespaced=True, verbs=VERBS,
                                                 subresources={"status"})
    server.resources[SERVICES] = ResourceInfo(kind="Service", namespaced=True, verbs=VERBS)
    server.resources[CONFIGMAPS] = ResourceInfo(kind="ConfigMap", namespaced=True, verbs=VERBS)
    server.resources[PDBS] = ResourceInfo(kind="PodDisruptionBudget", namespaced=True, verbs=VERBS)
    # routing mode router: the router's ServiceAccount and its EndpointSlice reader Role and binding.
    server.resources[SERVICE_ACCOUNTS] = ResourceInfo(kind="ServiceAccount", namespaced=True, verbs=VERBS)
    server.resources[ROLES] = ResourceInfo(kind="Role", namespaced=True, verbs=VERBS)
    server.resources[ROLE_BINDINGS] = ResourceInfo(kind="RoleBinding", namespaced=True, verbs=VERBS)
    # The autoscaler lists pods and posts Events. Nothing here runs a kubelet: tests create pods with the
    # status (podIP, the Ready condition) a kubelet would have written.
    server.resources[PODS] = ResourceInfo(kind="Pod", namespaced=True, verbs=VERBS, subresources={"status"})
    server.resources[EVENTS] = ResourceInfo(kind="Event", namespaced=True, verbs=VERBS)
    server.resources["v1/namespaces"] = ResourceInfo(kind="Namespace", namespaced=False, verbs=VERBS)
    server.resources["apiextensions.k8s.io/v1/customresourcedefinitions"] = ResourceInfo(
        kind="CustomResourceDefinition", namespaced=False, verbs=VERBS)


def serve_leader_worker_sets(server: KubernetesEmulator) -> None:
    """Serve the LeaderWorkerSet API, as a cluster with LWS installed does (declare_resources leaves it out,
    as a cluster without LWS answers 404). Nothing here runs the LWS controller: tests write the status it
    would (replicas, readyReplicas, updatedReplicas, conditions) through the status subresource, and the
    emulator neither validates nor defaults an LWS (tests/operator/test_multinode.py validates it against
    the vendored upstream CRD)."""
    server.resources[LWS] = ResourceInfo(kind="LeaderWorkerSet", namespaced=True, verbs=VERBS,
                                         shortnames={"lws"}, subresources={"status", "scale"})
