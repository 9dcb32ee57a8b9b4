"""Prefix-cache isolation (`admission.isolatePrefixCache`): one tenant's prompts never share the
engine's cached K/V with another tenant's.

The engine keys cached blocks by a hash chain rooted in the request's `cache_salt` (vLLM's field), so
requests with different salts never hit each other's prefixes; without isolation a tenant could also
time another tenant's prompts by how fast a guessed prefix comes back. This component sets the salt
from the `x-tenant` header on every completion request, overwriting any salt the client sent, so no
tenant can claim another's. The salt is a digest of the tenant name (a fixed length, whatever the
header holds, and no tenant name reaches the engine); requests without the header share one default
salt that no tenant's digest can equal.
"""

from __future__ import annotations

import hashlib

from starlette.types import ASGIApp, Receive, Scope, Send

from decodeservice.proxy.context import get_context

CACHE_SALT_FIELD = "cache_salt"
NO_TENANT_SALT = "no-tenant"  # a digest salt is "tenant-" + 64 hex digits, so it can never be this


def tenant_salt(tenant: str | None) -> str:
    if tenant is None:
        return NO_TENANT_SALT
    return "tenant-" + hashlib.sha256(tenant.encode("utf-8", "surrogatepass")).hexdigest()


class PrefixCacheIsolation:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            ctx = get_context(scope)
            ctx.body[CACHE_SALT_FIELD] = tenant_salt(ctx.tenant)
            ctx.body_rewritten = True
        await self.app(scope, receive, send)
