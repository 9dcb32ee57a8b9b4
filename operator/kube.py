"""A small async Kubernetes API client for the children: get, create, merge-patch, delete.

kopf owns the DecodeService itself; for the Deployments, Services, ConfigMaps and PDBs we talk to the API
with the same credentials kopf logged in with (a `kopf.ConnectionInfo`), over aiohttp (kopf's own
dependency). Every failure becomes an `ApiError` carrying the HTTP status, so the handlers can tell the
retryable (5xx, 409, 429, network) from the permanent.
"""

from __future__ import annotations

import asyncio
import base64
import ssl
import tempfile
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import kopf

from decodeservice.operator.errors import ApiError


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
}


def kind_of(obj: Mapping[str, Any]) -> Kind:
    try:
        return KINDS[str(obj["kind"])]
    except KeyError:
        raise ValueError(f"unsupported child kind {obj.get('kind')!r}") from None


def _ssl_context(info: kopf.ConnectionInfo) -> ssl.SSLContext | bool:
    if info.insecure:
        return False
    ctx = ssl.create_default_context(cafile=info.ca_path)
    if info.ca_data:
        data = info.ca_data
        ctx.load_verify_locations(cadata=data.decode() if isinstance(data, bytes) else str(data))
    cert_path, key_path = info.certificate_path, info.private_key_path
    if info.certificate_data and info.private_key_data:
        # ssl wants files; these live only as long as the process (the API client is long-lived).
        cert_path, key_path = _tempfile(info.certificate_data), _tempfile(info.private_key_data)
    if cert_path and key_path:
        ctx.load_cert_chain(cert_path, key_path)
    return ctx


def _tempfile(data: bytes | str) -> str:
    with tempfile.NamedTemporaryFile(delete=False, suffix=".pem") as f:
        f.write(data if isinstance(data, bytes) else data.encode())
        return f.name


class KubeClient:
    """One aiohttp session against one API server; create it inside the operator's event loop."""

    def __init__(self, info: kopf.ConnectionInfo, *, timeout_seconds: float = 30.0) -> None:
        headers = {"Accept": "application/json", "User-Agent": "decodeservice-operator"}
        if info.token:
            headers["Authorization"] = f"{info.scheme or 'Bearer'} {info.token}"
        elif info.username and info.password:
            creds = base64.b64encode(f"{info.username}:{info.password}".encode()).decode()
            headers["Authorization"] = f"Basic {creds}"
        self._server = info.server.rstrip("/")
        self._ssl = _ssl_context(info)
        self._session = aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_seconds))

    async def close(self) -> None:
        await self._session.close()
        # aiohttp closes plain transports on the next loop iterations; give them those before the loop ends.
        await asyncio.sleep(0.05)

    async def _request(self, method: str, path: str, *, body: Any = None,
                       content_type: str = "application/json") -> dict[str, Any]:
        kwargs: dict[str, Any] = {"ssl": self._ssl}
        if body is not None:
            kwargs["json"] = body
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
