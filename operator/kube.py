"""A small async Kubernetes API client for the children: get, server-side apply, delete.

kopf owns the DecodeService itself; for the Deployments, LeaderWorkerSets, Services, ConfigMaps, PDBs and
InferencePools we
talk to the API with the same credentials kopf logged in with (a `kopf.ConnectionInfo`), over aiohttp
(kopf's own dependency). Every failure becomes an `ApiError` carrying the HTTP status, so the handlers can
tell the retryable (5xx, 409, 429, network) from the permanent.

Credentials: `login` tries the official `kubernetes` client first (through `kopf.login_via_client`, so
exec plugins for EKS, GKE and OIDC and auth providers work), then the pod's service account, then kopf's
own kubeconfig reader. The TLS context and headers are built from the `ConnectionInfo` alone. Its
`*_data` fields may be PEM or, straight from a kubeconfig's `*-data`, base64 of PEM; both are accepted.
Key material never lands in a file we write: Python's `ssl` loads a client certificate and key only
from a path, so on Linux the PEM goes into an anonymous memory file (`os.memfd_create`) that is read
through `/proc/self/fd/N` and closed at once. Elsewhere it goes into a private 0700 temporary directory
that is removed as soon as the context has loaded it. (The official client, when it is the one that
logged in, writes a kubeconfig's `*-data` into its own mkstemp files and removes them at exit; kopf
passes us those paths. That is the `kubernetes` package's doing, not ours.)
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import os
import ssl
import tempfile
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import kopf

from decodeservice.operator.errors import ApiError

FIELD_MANAGER = "decodeservice-operator"
APPLY_PATCH = "application/apply-patch+yaml"  # a JSON body is valid YAML


@dataclass(frozen=True, kw_only=True)
class Kind:
    api_version: str
    plural: str

    def path(self, namespace: str, name: str | None = None) -> str:
        base = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        path = f"{base}/namespaces/{namespace}/{self.plural}"
        return f"{path}/{name}" if name is not None else path


KINDS: dict[str, Kind] = {
    "ConfigMap": Kind(api_version="v1", plural="configmaps"),
    "Service": Kind(api_version="v1", plural="services"),
    "Deployment": Kind(api_version="apps/v1", plural="deployments"),
    "PodDisruptionBudget": Kind(api_version="policy/v1", plural="poddisruptionbudgets"),
    "InferencePool": Kind(api_version="inference.networking.k8s.io/v1", plural="inferencepools"),
    "LeaderWorkerSet": Kind(api_version="leaderworkerset.x-k8s.io/v1", plural="leaderworkersets"),
    # routing mode router: the router's identity and its EndpointSlice reader Role (operator/router.py).
    "ServiceAccount": Kind(api_version="v1", plural="serviceaccounts"),
    "Role": Kind(api_version="rbac.authorization.k8s.io/v1", plural="roles"),
    "RoleBinding": Kind(api_version="rbac.authorization.k8s.io/v1", plural="rolebindings"),
}


def kind_of(obj: Mapping[str, Any]) -> Kind:
    try:
        return KINDS[str(obj["kind"])]
    except KeyError:
        raise ValueError(f"unsupported child kind {obj.get('kind')!r}") from None


def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """A kopf login handler: the official client, then the service account, then the kubeconfig."""
    logger = kwargs.get("logger")
    try:
        info = kopf.login_via_client(**kwargs)
    except kopf.LoginError as exc:
        if logger is not None:
            logger.info(f"the kubernetes client could not log in ({exc}); trying the service account")
        info = None
    return info or kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


def pem(data: str | bytes) -> bytes:
    """PEM bytes from PEM or base64-of-PEM (a kubeconfig's `*-data`, which kopf leaves encoded)."""
    raw = data.encode() if isinstance(data, str) else bytes(data)
    if raw.lstrip().startswith(b"-----BEGIN "):
        return raw
    try:
        decoded = base64.b64decode(raw, validate=False)
    except (binascii.Error, ValueError) as exc:
        raise kopf.LoginError(f"certificate data is neither PEM nor base64 of PEM: {exc}") from None
    if not decoded.lstrip().startswith(b"-----BEGIN "):
        raise kopf.LoginError("certificate data is neither PEM nor base64 of PEM")
    return decoded


def _read(path: str | bytes | os.PathLike[str] | os.PathLike[bytes]) -> bytes:
    return Path(os.fsdecode(path)).read_bytes()


def load_cert_chain_from_memory(ctx: ssl.SSLContext, chain: bytes, *,
                                use_memfd: bool = hasattr(os, "memfd_create")) -> None:
    """`ctx.load_cert_chain` for a PEM (certificate, then key) that must not be written to a disk."""
    if use_memfd:
        fd = os.memfd_create("decodeservice-client-cert", os.MFD_CLOEXEC)
        try:
            view = memoryview(chain)
            while view:
                view = view[os.write(fd, view):]
            ctx.load_cert_chain(f"/proc/self/fd/{fd}")
        finally:
            os.close(fd)
        return
    with tempfile.TemporaryDirectory(prefix="decodeservice-tls-") as folder:  # 0700, removed on exit
        path = os.path.join(folder, "chain.pem")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(chain)
        ctx.load_cert_chain(path)


def ssl_context(info: kopf.ConnectionInfo) -> ssl.SSLContext:
    """CA, client certificate and verification mode from a ConnectionInfo, nothing left on disk."""
    cadata = pem(info.ca_data).decode("ascii") if info.ca_data else None
    ctx = ssl.create_default_context(cafile=os.fsdecode(info.ca_path) if info.ca_path else None, cadata=cadata)
    cert_path, key_path = info.certificate_path, info.private_key_path
    if cert_path and key_path:
        ctx.load_cert_chain(os.fsdecode(cert_path), os.fsdecode(key_path))
    elif (info.certificate_data or cert_path) and (info.private_key_data or key_path):
        cert = pem(info.certificate_data) if info.certificate_data else _read(cert_path or "")
        key = pem(info.private_key_data) if info.private_key_data else _read(key_path or "")
        load_cert_chain_from_memory(ctx, cert.rstrip(b"\n") + b"\n" + key)
    if info.insecure:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


class KubeClient:
    """One aiohttp session against one API server; create it inside the operator's event loop."""

    def __init__(self, info: kopf.ConnectionInfo, *, timeout_seconds: float = 30.0) -> None:
        # kopf's own rendering of the credentials: bearer token, scheme + token, or basic auth.
        headers = {"Accept": "application/json", "User-Agent": FIELD_MANAGER, **info.as_http_headers()}
        self._server = info.server.rstrip("/")
        self._ssl = ssl_context(info)
        self._proxy = info.proxy_url
        self._session = aiohttp.ClientSession(headers=headers, trust_env=info.trust_env,
                                              timeout=aiohttp.ClientTimeout(total=timeout_seconds))

    async def close(self) -> None:
        await self._session.close()
        # aiohttp closes plain transports on the next loop iterations; give them those before the loop ends.
        await asyncio.sleep(0.05)

    async def _request(self, method: str, path: str, *, body: Any = None, content_type: str = "application/json",
                       params: Mapping[str, str] | None = None) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"ssl": self._ssl, "proxy": self._proxy, "params": dict(params or {})}
        if body is not None:
            kwargs["data"] = json.dumps(body).encode()
            kwargs["headers"] = {"Content-Type": content_type}
        try:
            async with self._session.request(method, self._server + path, **kwargs) as resp:
                payload: Any = await resp.json(content_type=None) if resp.content_length != 0 else {}
                if resp.status >= 400:
                    info = payload if isinstance(payload, dict) else {}
                    raise ApiError(status=resp.status, api_reason=str(info.get("reason") or resp.reason),
                                   message=str(info.get("message") or ""))
                return payload if isinstance(payload, dict) else {}
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            # Status 0: the request never got an API answer (connection reset, timeout, garbage body).
            raise ApiError(status=0, api_reason=type(exc).__name__, message=str(exc)) from exc

    async def get(self, kind: Kind, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await self._request("GET", kind.path(namespace, name))
        except ApiError as exc:
            if exc.not_found:
                return None
            raise

    async def create(self, kind: Kind, namespace: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return await self._request("POST", kind.path(namespace), body=dict(body))

    async def patch(self, kind: Kind, namespace: str, name: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return await self._request("PATCH", kind.path(namespace, name), body=dict(body),
                                   content_type="application/merge-patch+json")

    async def apply(self, kind: Kind, namespace: str, name: str, body: Mapping[str, Any], *,
                    field_manager: str = FIELD_MANAGER, force: bool = True) -> dict[str, Any]:
        """Server-side apply: create or update, and drop what `field_manager` applied before and no longer does.

        `force` takes over fields another manager set (someone's `kubectl edit`): we own what we apply."""
        return await self._request("PATCH", kind.path(namespace, name), body=dict(body), content_type=APPLY_PATCH,
                                   params={"fieldManager": field_manager, "force": "true" if force else "false"})

    async def json_patch(self, kind: Kind, namespace: str, name: str, ops: list[dict[str, Any]]) -> dict[str, Any]:
        """RFC 6902 JSON patch (used with a `test` of resourceVersion, so it fails rather than races)."""
        return await self._request("PATCH", kind.path(namespace, name), body=list(ops),
                                   content_type="application/json-patch+json")

    async def delete(self, kind: Kind, namespace: str, name: str) -> None:
        try:
            await self._request("DELETE", kind.path(namespace, name))
        except ApiError as exc:
            if not exc.not_found:
                raise

    # The autoscaler's calls (operator/autoscaler/controller.py).

    async def list_pods(self, namespace: str, selector: Mapping[str, str]) -> list[dict[str, Any]]:
        """Pods carrying every label of `selector`."""
        query = urllib.parse.urlencode({"labelSelector": ",".join(f"{k}={v}" for k, v in selector.items())})
        payload = await self._request("GET", f"/api/v1/namespaces/{namespace}/pods?{query}")
        items = payload.get("items") or []
        # Matched here as well: the selector is our contract whatever the server (or an emulator) did.
        return [p for p in items if isinstance(p, dict)
                and all(((p.get("metadata") or {}).get("labels") or {}).get(k) == v for k, v in selector.items())]

    async def patch_status(self, kind: Kind, namespace: str, name: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return await self._request("PATCH", kind.path(namespace, name) + "/status", body=dict(body),
                                   content_type="application/merge-patch+json")

    async def post_event(self, namespace: str, event: Mapping[str, Any]) -> None:
        """Create a core v1 Event."""
        await self._request("POST", f"/api/v1/namespaces/{namespace}/events", body=dict(event))
