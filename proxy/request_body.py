"""JSON body parser: the outermost policy component of the completion routes.

It enforces `outputLength.maxBodyBytes` with the shared reader (`decodeservice.common.body`: 413
before anything reaches the upstream, checked against Content-Length first), parses the JSON object (400 when it is
not one), reads `x-priority` / `x-tenant`, and puts the `RequestContext` into the scope.
"""

from __future__ import annotations

import json
import time

from starlette.types import ASGIApp, Receive, Scope, Send

from decodeservice.common.body import read_body
from decodeservice.common.errors import BadRequest
from decodeservice.proxy.context import RequestContext, set_context
from decodeservice.proxy.policy import PriorityClass

PRIORITY_HEADER = "x-priority"
TENANT_HEADER = "x-tenant"
_PRIORITY_KEY = PRIORITY_HEADER.encode()
_TENANT_KEY = TENANT_HEADER.encode()


class JsonBody:
    def __init__(self, app: ASGIApp, *, max_body_bytes: int, default_class: PriorityClass):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.default_class = default_class

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        arrived = time.perf_counter()
        # One pass over the raw headers instead of a Headers object: the first value wins, as with
        # Headers.get, and ASGI servers already lower-case the names.
        declared: str | None = None
        priority_value: str | None = None
        tenant: str | None = None
        for key, value in scope["headers"]:
            if key == b"content-length":
                declared = declared if declared is not None else value.decode("latin-1")
            elif key == _PRIORITY_KEY:
                priority_value = priority_value if priority_value is not None else value.decode("latin-1")
            elif key == _TENANT_KEY:
                tenant = tenant if tenant is not None else value.decode("latin-1")
        priority = self._priority(priority_value)
        raw = await read_body(receive, limit=self.max_body_bytes, content_length=declared)
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise BadRequest(f"request body is not valid JSON: {exc}", reason="malformed_json") from None
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object", reason="malformed_json")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise BadRequest("`stream` must be a boolean", param="stream", reason="invalid_field")
        ctx = RequestContext(body=body, raw_body=raw, body_rewritten=False, priority=priority,
                             tenant=tenant or None, arrived=arrived, stream=stream)
        set_context(scope, ctx)
        await self.app(scope, receive, send)

    def _priority(self, value: str | None) -> PriorityClass:
        if value is None or value == "":
            return self.default_class
        try:
            return PriorityClass(value.strip().lower())
        except ValueError:
            allowed = ", ".join(p.value for p in PriorityClass)
            raise BadRequest(
                f"header {PRIORITY_HEADER} must be one of: {allowed} (got {value!r})",
                param=PRIORITY_HEADER, reason="invalid_priority",
            ) from None
