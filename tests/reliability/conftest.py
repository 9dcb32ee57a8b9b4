"""The reliability suite's shared pieces: the real engine (in-process, bundled model) with the real
proxy in front, both on loopback; the idle check; and the counts, printed as JSON at the end.

Run it with `-s` or read the terminal summary: one JSON line per scenario with tried, survived and lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette

from decodeservice.engine.outputs import EngineStats
from tests.conftest import ModelBundle
from tests.engine.test_server_harness import RunningServer, running_server
from tests.proxy.conftest import running_proxy
from tests.reliability.outcomes import Tally

TALLIES = pytest.StashKey[list[dict[str, Any]]]()
# Small enough that a handful of requests fills it; big enough for one sequence of max_model_len.
ENGINE_CONFIG: dict[str, Any] = {"kv_cache_gib": 0.05, "max_model_len": 512, "max_num_seqs": 8}


def pytest_configure(config: pytest.Config) -> None:
    config.stash[TALLIES] = []


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    tallies = config.stash.get(TALLIES, [])
    if tallies:
        terminalreporter.section("reliability counts (JSON)")
        for tally in tallies:
            terminalreporter.write_line(json.dumps(tally))
        totals = {k: sum(t[k] for t in tallies) for k in ("tried", "survived", "lost")}
        terminalreporter.write_line(json.dumps({"scenario": "TOTAL", **totals}))


@pytest.fixture
def record(request: pytest.FixtureRequest) -> Callable[[Tally], dict[str, Any]]:
    """Record a scenario's tally for the summary; returns it, so the test can assert on it."""
    def add(tally: Tally) -> dict[str, Any]:
        summary = tally.summary()
        request.config.stash[TALLIES].append(summary)
        print(json.dumps(summary))
        return summary
    return add


async def wait_for(condition: Callable[[], bool], *, timeout: float, what: str) -> None:
    """Poll a condition without blocking the loop the proxy runs on."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)


def is_idle(stats: EngineStats) -> bool:
    # Idle: nothing running or waiting, and every block free (cached prefixes sit in the free queue).
    return stats.num_running == 0 and stats.num_waiting == 0 and stats.num_free_blocks == stats.num_blocks


async def assert_engine_idle(srv: RunningServer, timeout: float = 30.0) -> None:
    await wait_for(lambda: is_idle(srv.aengine.stats()) and srv.aengine.num_unfinished == 0, timeout=timeout,
                   what=f"the engine to go idle (now {srv.aengine.stats()})")


@pytest.fixture(scope="module")
def engine_srv(bundled: ModelBundle) -> Iterator[RunningServer]:
    with running_server(lambda: bundled.engine(**ENGINE_CONFIG)) as running:
        yield running


@dataclass
class Stack:
    engine: RunningServer
    proxy: Starlette
    client: httpx.AsyncClient

    async def proxy_metrics(self) -> str:
        return (await self.client.get("/metrics")).text


@contextlib.asynccontextmanager
async def stack(engine: RunningServer, policy: dict[str, Any] | None = None) -> AsyncIterator[Stack]:
    async with running_proxy(policy or {}, engine.url) as (app, client):
        client.timeout = httpx.Timeout(120.0)
        yield Stack(engine, app, client)
