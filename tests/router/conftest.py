"""Routers on loopback in front of fake engines (tests/support/fake_engine.py), all real uvicorn servers."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx

from decodeservice.proxy.app import ProxyApp
from decodeservice.proxy.policy import Policy
from decodeservice.router.app import create_app
from decodeservice.router.config import RouterConfig
from decodeservice.router.endpoints import StaticEndpoints
from tests.support.fake_engine import FakeEngine, serve_loopback


@contextlib.asynccontextmanager
async def fake_engines(n: int, **knobs: Any) -> AsyncIterator[list[FakeEngine]]:
    async with contextlib.AsyncExitStack() as stack:
        engines = []
        for _ in range(n):
            engine = FakeEngine(**knobs)
            engine.url = await stack.enter_async_context(serve_loopback(engine.app()))
            engines.append(engine)
        yield engines


@contextlib.asynccontextmanager
async def running_router(urls: list[str], *, policy: dict[str, Any] | None = None, wait_ready: int | None = None,
                         **config: Any) -> AsyncIterator[tuple[ProxyApp, httpx.AsyncClient]]:
    """A router over `urls`, served on loopback, with a client; waits until `wait_ready` (default: all)
    endpoints are ready."""
    config.setdefault("scrape_interval_s", 0.05)
    app = create_app(RouterConfig(policy=Policy.model_validate(policy or {}), **config),
                     StaticEndpoints(urls=tuple(urls)))
    async with serve_loopback(app) as url, httpx.AsyncClient(base_url=url, timeout=10.0) as client:
        want = len(urls) if wait_ready is None else wait_ready
        await wait_until(lambda: len(app.state.fleet.ready_urls()) >= want)
        yield app, client


async def wait_until(predicate: Callable[[], bool], *, timeout: float = 5.0) -> None:
    """Wait (bounded) for a condition another task or process brings about."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met within {timeout} s")
        await asyncio.sleep(0.01)


def chat(text: str, *, stream: bool = True, max_tokens: int = 4) -> dict[str, Any]:
    return {"model": "fake-model", "messages": [{"role": "system", "content": "Be brief."},
                                                {"role": "user", "content": text}],
            "max_tokens": max_tokens, "stream": stream}


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of `name` with these labels in a Prometheus text body (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()))
