"""The one OpenAI error vocabulary, as both servers render it."""

from __future__ import annotations

import json

import pytest

from decodeservice.common.errors import (
    BadRequest,
    Draining,
    NotFound,
    OpenAIError,
    PayloadTooLarge,
    RateLimited,
    ServerError,
    ServiceUnavailable,
    error_type_for,
)


@pytest.mark.parametrize(("error", "status", "error_type"), [
    (BadRequest("x"), 400, "invalid_request_error"),
    (NotFound("x"), 404, "invalid_request_error"),
    (PayloadTooLarge("x"), 413, "invalid_request_error"),
    (RateLimited("x"), 429, "rate_limit_exceeded"),
    (ServerError("x"), 500, "server_error"),
    # OpenAI answers "overloaded or not ready" 503s as server_error; the openai client knows no other.
    (ServiceUnavailable("x"), 503, "server_error"),
    (Draining(), 503, "server_error"),
    (OpenAIError("x", status_code=405), 405, "invalid_request_error"),
])
def test_status_decides_the_type(error: OpenAIError, status: int, error_type: str) -> None:
    assert error.status_code == status and error.error_type == error_type == error_type_for(status)


def test_rendered_body_has_exactly_the_openai_fields() -> None:
    error = BadRequest("bad max_tokens", param="max_tokens", code="invalid_value", headers={"X-A": "1"})
    response = error.to_response()
    assert response.status_code == 400 and response.headers["x-a"] == "1"
    assert response.headers["content-type"] == "application/json"
    assert json.loads(bytes(response.body)) == {"error": {
        "message": "bad max_tokens", "type": "invalid_request_error", "param": "max_tokens", "code": "invalid_value"}}
    assert json.loads(error.json()) == error.body()


def test_class_code_can_be_overridden_and_reason_defaults_to_it() -> None:
    assert PayloadTooLarge("x").code == "request_too_large"
    assert ServiceUnavailable("x", code="not_ready").reason == "not_ready"
    assert BadRequest("x").reason == "invalid_request_error"
    assert BadRequest("x", code="c", reason="why").reason == "why"
    draining = Draining()
    assert draining.code == "draining" and draining.headers == {"Retry-After": "1"}
