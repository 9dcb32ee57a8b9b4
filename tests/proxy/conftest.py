"""Shared fixtures: a fake engine and the proxy, both real uvicorn servers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import httpx
import pytest
import uvloop
from starlette.applications import Starlette

from decodeservice.proxy.app import create_app
from decodeservice.proxy.policy import Policy
from tests.support.fake_engine import FakeEngine, serve_loopback


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item,
                                  ) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    """The transport's tests run on both loops: its protocol callbacks are driven by the loop, and
    `decodectl proxy` runs on uvloop, whose transports differ from asyncio's in detail."""
    if item.path.name == "test_upstream_transport.py":
        return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
    return {"asyncio": asyncio.new_event_loop}


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
