"""EndpointSlices in the API emulator, listed and watched by label selector as a real API server serves them.

kmock lists and watches every object of a resource in the namespace whatever the `labelSelector`; the
router asks for `kubernetes.io/service-name=<name>-pods` and must not see another Service's slices.
`SelectingApiServer` filters list results and watch events by the selector's equality terms (`k=v`,
`k==v`, `k!=v`, `k`, `!k`; set terms such as `k in (a,b)` are refused with 400 rather than ignored).
What it leaves out: a real API server turns an update that makes an object stop matching into a
DELETED event for the watcher, and serves a watch from the list's resourceVersion; here such an update
is simply not sent, and every watch starts with the matching objects as ADDED events (kmock's way),
which a client that lists first (the router) takes as the same state again.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any

from kmock import KubernetesError, ResourceInfo

from tests.support.kube_emulator import VERBS, ApiServer

ENDPOINT_SLICES = "discovery.k8s.io/v1/endpointslices"
Selector = list[tuple[str, str, str | None]]  # (key, op: "=" "!=" "exists" "absent", value)


def declare_endpoint_slices(server: ApiServer) -> None:
    server.resources[ENDPOINT_SLICES] = ResourceInfo(kind="EndpointSlice", namespaced=True, verbs=VERBS)


def parse_selector(text: str | None) -> Selector:
    terms: Selector = []
    for raw in (text or "").split(","):
        term = raw.strip()
        if not term:
            continue
        if " in " in term or " notin " in term or "(" in term:
            raise KubernetesError(status=400, reason="BadRequest", message=f"set-based selector {term!r} not served")
        if "!=" in term:
            key, value = term.split("!=", 1)
            terms.append((key.strip(), "!=", value.strip()))
        elif "=" in term:
            key, value = term.split("==", 1) if "==" in term else term.split("=", 1)
            terms.append((key.strip(), "=", value.strip()))
        elif term.startswith("!"):
            terms.append((term[1:].strip(), "absent", None))
        else:
            terms.append((term, "exists", None))
    return terms


def matches(obj: Mapping[str, Any], selector: Selector) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    for key, op, value in selector:
        if op == "=" and labels.get(key) != value:
            return False
        if op == "!=" and labels.get(key) == value:
            return False
        if op == "exists" and key not in labels:
            return False
        if op == "absent" and key in labels:
            return False
    return True


class SelectingApiServer(ApiServer):
    """ApiServer whose list and watch honour `labelSelector` (see the module docstring)."""

    async def _serve_list(self, request: Any) -> Any:
        selector = parse_selector(request.params.get("labelSelector"))
        result = await super()._serve_list(request)
        result["items"] = [obj for obj in result["items"] if matches(obj, selector)]
        return result

    async def _serve_watch(self, request: Any) -> AsyncIterator[Any]:
        selector = parse_selector(request.params.get("labelSelector"))
        async for event in super()._serve_watch(request):
            if isinstance(event, Mapping) and not matches(event.get("object") or {}, selector):
                continue
            yield event
