"""The proxy's exception tree and the OpenAI error body every failure is answered with.

`ProxyError` is the root. Each subclass carries the HTTP status and the OpenAI error `type`/`code` it is
answered with, so the ASGI components raise (or build) one object and `error_response` renders it the
same way everywhere: `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from starlette.responses import Response


class PolicyError(ValueError):
    """A policy file or mapping that does not validate; the message names each bad field."""


class ProxyError(Exception):
    """A request the proxy answers itself, with an OpenAI error body."""

    status_code = 500
    error_type = "server_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
        reason: str | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers = dict(headers or {})
        # The metric label: why it was refused (e.g. "max_tokens", "slo", "queue_full").
        self.reason = reason or self.code or self.error_type

    def to_response(self) -> Response:
        return error_response(
            self.status_code, self.message, error_type=self.error_type, param=self.param, code=self.code,
            headers=self.headers,
        )


class BadRequest(ProxyError):
    status_code = 400
    error_type = "invalid_request_error"


class PayloadTooLarge(ProxyError):
    status_code = 413
    error_type = "invalid_request_error"
    code = "payload_too_large"


class Overloaded(ProxyError):
    """Shed by admission or rate limiting: retry later, as `Retry-After` says."""

    status_code = 429
    error_type = "rate_limit_exceeded"
    code = "rate_limit_exceeded"


class UpstreamUnavailable(ProxyError):
    status_code = 503
    error_type = "service_unavailable"
    code = "upstream_unavailable"


class Draining(ProxyError):
    status_code = 503
    error_type = "service_unavailable"
    code = "draining"


def error_body(message: str, *, error_type: str, param: str | None = None, code: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": error_type, "param": param, "code": code}}).encode()


def error_response(
    status_code: int,
    message: str,
    *,
    error_type: str,
    param: str | None = None,
    code: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> Response:
    return Response(
        error_body(message, error_type=error_type, param=param, code=code),
        status_code=status_code,
        media_type="application/json",
        headers=dict(headers or {}),
    )
