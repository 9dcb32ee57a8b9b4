"""Shared fixtures: a fake engine and the proxy, both real uvicorn servers on 127.0.0.1."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette

from decodeservice.bench.fake_engine import FakeEngine, serve_loopback
from decodeservice.proxy.app import create_app
from decodeservice.proxy.policy import Policy


@pytest.fixture
async def engine() -> AsyncIterator[FakeEngine]:
    fake = FakeEngine()
    async with serve_loopback(fake.app()) as url:
        fake.url = url
        yield fake


@contextlib.asynccontextmanager
async def running_proxy(
    policy: Policy | dict[str, Any], upstream_url: str, **kwargs: Any
) -> AsyncIterator[tuple[Starlette, httpx.AsyncClient]]:
    """The proxy app served on loopback, with a client pointed at it."""
    if not isinstance(policy, Policy):
        policy = Policy.model_validate(policy)
    app = create_app(policy, upstream_url, **kwargs)
    async with serve_loopback(app) as url, httpx.AsyncClient(base_url=url, timeout=10.0) as client:
        yield app, client


@pytest.fixture
def proxy() -> Any:
    return running_proxy
