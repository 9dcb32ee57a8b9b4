"""The per-request record the policy components share, kept in the ASGI scope.

The body parser creates it; each policy reads and amends it (clamped limit, prompt token count, queue
wait); the forwarder sends `body` upstream and fills in the timings.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from starlette.types import Scope

from decodeservice.proxy.policy import PriorityClass

SCOPE_KEY = "decode_proxy.request"
# The status the relay sent, for the error boundary's metrics: recorded here rather than by wrapping
# `send`, which would add a call to every chunk of every stream.
STATUS_KEY = "decode_proxy.status"


@dataclasses.dataclass(kw_only=True, slots=True)
class RequestContext:
    body: dict[str, Any]  # the parsed JSON body; policies rewrite it in place before it is forwarded
    # The bytes the client sent. Forwarded as they are unless a policy set `body_rewritten`, which
    # saves re-serialising a body nobody changed.
    raw_body: bytes = b""
    body_rewritten: bool = True
    priority: PriorityClass
    tenant: str | None
    arrived: float  # time.perf_counter() when the request reached the proxy
    stream: bool
    max_tokens: int | None = None  # the effective output limit once the length policy ran
    prompt_tokens: int | None = None  # counted only when a policy needs it
    clamped_from: int | None = None
    queue_wait: float = 0.0  # seconds waiting for an upstream slot
    window_hold: float = 0.0  # seconds held by the batching window
    output_tokens: int = 0
    client_disconnected: bool = False
    # Added to the relayed response head (e.g. `x-decode-clamped`), so no policy has to wrap `send`.
    response_headers: list[tuple[bytes, bytes]] = dataclasses.field(default_factory=list)


def get_context(scope: Scope) -> RequestContext:
    ctx = scope.get(SCOPE_KEY)
    # Internal invariant: the body parser is always outermost of the policy chain.
    assert isinstance(ctx, RequestContext), "policy component mounted without the JSON body parser"
    return ctx


def set_context(scope: Scope, ctx: RequestContext) -> None:
    scope[SCOPE_KEY] = ctx


def set_response_status(scope: Scope, status: int) -> None:
    scope[STATUS_KEY] = status


def response_status(scope: Scope) -> int:
    """The status sent to the client, or 0 when no response head was sent."""
    status = scope.get(STATUS_KEY, 0)
    return status if isinstance(status, int) else 0
