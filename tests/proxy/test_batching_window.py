"""Batching window: holding until maxBatch or the window closes; interactive with window 0 passes."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from decodeservice.proxy.policy import PriorityClass
from tests.support.fake_engine import FakeEngine

B = PriorityClass.BATCH


def _hold_histogram(text: str, cls: str) -> tuple[float, float]:
    samples = {s.name: s.value for f in text_string_to_metric_families(text)
               if f.name == "decode_proxy:batch_window_hold_seconds" for s in f.samples
               if s.labels.get("class") == cls and s.name.endswith(("_count", "_sum"))}
    return samples["decode_proxy:batch_window_hold_seconds_count"], samples["decode_proxy:batch_window_hold_seconds_sum"]


def _post(client: Any, priority: str) -> Any:
    return client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers={"x-priority": priority})


async def test_held_until_max_batch_then_released_together(engine: FakeEngine, proxy: Any) -> None:
    policy = {"classes": {"batch": {"batchWindowMs": 10_000, "maxBatch": 3}}}
    async with proxy(policy, engine.url) as (app, client):
        window = app.state.window
        first = [asyncio.create_task(_post(client, "batch")) for _ in range(2)]
        await engine.wait_for(lambda _: window.held(B) == 2)
        assert engine.received == []  # held, not forwarded
        started = time.perf_counter()
        last = await _post(client, "batch")
        assert all(r.status_code == 200 for r in [last, *await asyncio.gather(*first)])
        assert time.perf_counter() - started < 5.0  # released by maxBatch, far before the 10 s window
        assert len(engine.received) == 3
        count, _ = _hold_histogram((await client.get("/metrics")).text, "batch")
    assert count == 3


async def test_window_close_releases_a_partial_batch(engine: FakeEngine, proxy: Any) -> None:
    policy = {"classes": {"batch": {"batchWindowMs": 150, "maxBatch": 10}}}
    async with proxy(policy, engine.url) as (_, client):
        responses = await asyncio.gather(*(_post(client, "batch") for _ in range(2)))
        assert [r.status_code for r in responses] == [200, 200]
        count, total = _hold_histogram((await client.get("/metrics")).text, "batch")
    assert count == 2
    assert total >= 2 * 0.14  # each was held about the whole window
    assert engine.start_times == [] and len(engine.received) == 2


async def test_interactive_window_zero_is_not_held(engine: FakeEngine, proxy: Any) -> None:
    policy = {"classes": {"batch": {"batchWindowMs": 600, "maxBatch": 10}}}
    async with proxy(policy, engine.url) as (app, client):
        window = app.state.window
        batch = asyncio.create_task(_post(client, "batch"))
        await engine.wait_for(lambda _: window.held(B) == 1)
        r = await _post(client, "interactive")
        assert r.status_code == 200
        assert window.held(B) == 1 and len(engine.received) == 1  # the batch one is still held
        assert (await batch).status_code == 200
        count, total = _hold_histogram((await client.get("/metrics")).text, "interactive")
    assert count == 1 and total == 0.0
