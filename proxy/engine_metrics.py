"""The engine's `vllm:*` series, relayed on the proxy's own /metrics.

The operator's autoscaler reads one endpoint per pod (the proxy's), but needs the engine's KV-cache
usage and waiting requests too. So the proxy fetches the engine's `/metrics`, keeps only the `vllm:`
families (its own are `decode_proxy:`, so no name can clash), and appends them re-rendered by
prometheus_client, which also means a malformed upstream body cannot corrupt the proxy's exposition.

One fetch serves every scrape for `max_age_seconds` (50 ms), and concurrent scrapes share the fetch in
flight, so 20 scrapes a second cost the engine at most 20 fetches and usually far fewer. An upstream
that is down, slow or garbled yields no relayed series; the proxy's own are served regardless.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable

import httpx
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)
PREFIX = "vllm:"


class _Families:
    """A collector that yields already-parsed families, so generate_latest renders them."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self._families


def relay_text(upstream_text: str) -> bytes:
    """Only the `vllm:` families of an engine /metrics body, re-rendered; b"" when it does not parse."""
    try:
        families = [f for f in text_string_to_metric_families(upstream_text) if f.name.startswith(PREFIX)]
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Families(families))
        return generate_latest(registry)
    except Exception as exc:  # the parser raises ValueError, IndexError, ... on a garbled body
        log.warning("engine /metrics did not parse; relaying nothing: %s: %s", type(exc).__name__, exc)
        return b""


class EngineMetricsRelay:
    def __init__(self, client: httpx.AsyncClient, upstream_url: str, *, max_age_seconds: float = 0.05,
                 timeout_seconds: float = 1.0, max_body_bytes: int = 4 << 20) -> None:
        self._client = client
        self._url = upstream_url.rstrip("/") + "/metrics"
        self._max_age = max_age_seconds
        self._timeout = timeout_seconds
        self._max_bytes = max_body_bytes
        self._cached = b""
        self._fetched_at = -float("inf")
        self._inflight: asyncio.Task[bytes] | None = None
        self.fetches = 0  # upstream requests made (observability and tests)

    async def render(self) -> bytes:
        if time.monotonic() - self._fetched_at < self._max_age:
            return self._cached
        if self._inflight is None:
            self._inflight = asyncio.ensure_future(self._refresh())
        # Shielded: a scraper that hangs up must not cancel the fetch the others are waiting on.
        return await asyncio.shield(self._inflight)

    async def _refresh(self) -> bytes:
        try:
            self.fetches += 1
            self._cached = await self._fetch()
            self._fetched_at = time.monotonic()
            return self._cached
        finally:
            self._inflight = None

    async def _fetch(self) -> bytes:
        try:
            async with self._client.stream("GET", self._url, timeout=self._timeout) as resp:
                if resp.status_code != 200:
                    return b""
                body = bytearray()
                async for chunk in resp.aiter_bytes():
                    body += chunk
                    if len(body) > self._max_bytes:
                        log.warning("engine /metrics is over %d bytes; relaying nothing", self._max_bytes)
                        return b""
        except httpx.HTTPError:
            return b""  # the engine is down or starting: the proxy's own series are still served
        with contextlib.suppress(UnicodeDecodeError):
            return relay_text(body.decode("utf-8"))
        return b""
