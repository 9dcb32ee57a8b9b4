"""The proxy's own refusals, on top of the shared OpenAI error tree (`decodeservice.common.errors`).

Components raise an `OpenAIError` (`BadRequest`, `PayloadTooLarge`, or one of these) before answering;
the app's error boundary renders it and counts it by its `reason`.
"""

from __future__ import annotations

from decodeservice.common.errors import RateLimited, ServerError, ServiceUnavailable


class PolicyError(ValueError):
    """A policy file or mapping that does not validate; the message names each bad field."""


class Overloaded(RateLimited):
    """Shed by admission or rate limiting: retry later, as `Retry-After` says."""


class UpstreamUnavailable(ServiceUnavailable):
    code = "upstream_unavailable"


class UpstreamTimeout(ServerError):
    """The upstream sent no response head within `slo.firstTokenTimeoutMs` (a gateway timeout)."""

    status_code = 504
    code = "first_token_timeout"
