"""OpenAI error JSON, one exception tree and one vocabulary for the engine server and the proxy.

Every refusal is an `OpenAIError` carrying its HTTP status, rendered the same way everywhere:
`{"error": {"message", "type", "param", "code"}}`. `type` follows the status with the strings OpenAI's
API answers and its `openai` client documents: `invalid_request_error` for 4xx, `rate_limit_exceeded`
for 429, `server_error` for 5xx, 503 included (OpenAI's own "The server is overloaded or not ready
yet." is a 503 of type `server_error`; neither `service_unavailable` nor `service_unavailable_error`
is in that vocabulary). `code` says which refusal it is (`draining`, `not_ready`, ...).

`ProxyError`-style metric labels ride along as `reason` (default: the code, else the type).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response


def error_type_for(status_code: int) -> str:
    """The OpenAI error `type` for an HTTP status."""
    if status_code == 429:
        return "rate_limit_exceeded"
    if status_code >= 500:
        return "server_error"
    return "invalid_request_error"


class OpenAIError(Exception):
    """A request answered with an OpenAI error body. Subclasses fix the status (and often the code)."""

    status_code = 500
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        status_code: int | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
        reason: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if status_code is not None:
            self.status_code = status_code
        if code is not None:
            self.code = code
        self.param = param
        self.headers = dict(headers or {})
        self.error_type = error_type_for(self.status_code)
        # The proxy's metric label: why it was refused (e.g. "max_tokens", "slo", "queue_full").
        self.reason = reason or self.code or self.error_type

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param,
                          "code": self.code}}

    def json(self) -> bytes:
        return json.dumps(self.body()).encode()

    def to_response(self) -> Response:
        return Response(self.json(), status_code=self.status_code, media_type="application/json",
                        headers=self.headers)


class BadRequest(OpenAIError):
    status_code = 400


class NotFound(OpenAIError):
    status_code = 404


class PayloadTooLarge(OpenAIError):
    status_code = 413
    code = "request_too_large"


class RateLimited(OpenAIError):
    status_code = 429
    code = "rate_limit_exceeded"


class ServerError(OpenAIError):
    status_code = 500


class ServiceUnavailable(OpenAIError):
    status_code = 503


class Draining(ServiceUnavailable):
    """SIGTERM arrived: this replica finishes what it has and takes nothing new."""

    code = "draining"

    def __init__(self, message: str = "the server is shutting down; retry on another replica") -> None:
        super().__init__(message, headers={"Retry-After": "1"})


# -- Starlette exception handlers (exception_handlers={OpenAIError: ..., HTTPException: ...}) ------------
async def openai_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, OpenAIError)
    return exc.to_response()


async def http_exception_handler(request: Request, exc: Exception) -> Response:
    """Starlette's own 404/405 in OpenAI error JSON, the status as the code."""
    assert isinstance(exc, HTTPException)
    return OpenAIError(exc.detail, status_code=exc.status_code, code=str(exc.status_code),
                       headers=exc.headers).to_response()
