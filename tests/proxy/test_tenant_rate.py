"""Per-tenant token rate limit: the bucket itself, and 429 + Retry-After through the proxy."""

from __future__ import annotations

from typing import Any

import pytest

from decodeservice.proxy.tenant_rate import TokenBucket
from tests.support.fake_engine import FakeEngine


def test_bucket_refills_at_the_rate_and_caps_at_capacity() -> None:
    bucket = TokenBucket(capacity=60.0, refill_per_second=1.0, tokens=60.0, updated=0.0)
    assert bucket.try_take(50.0, now=0.0) == 0.0
    assert bucket.try_take(20.0, now=0.0) == pytest.approx(10.0)  # 10 left, 10 short at 1/s
    assert bucket.tokens == pytest.approx(10.0)  # a refused take takes nothing
    assert bucket.try_take(20.0, now=10.0) == 0.0
    bucket.give_back(1000.0, now=10.0)
    assert bucket.tokens == 60.0


async def test_tenant_over_its_rate_gets_429_others_do_not(engine: FakeEngine, proxy: Any) -> None:
    policy = {"admission": {"tenantTokensPerMinute": 20}}
    body = {"model": "m", "prompt": "a b", "max_tokens": 8}  # costs 2 prompt + 8 output tokens
    async with proxy(policy, engine.url) as (_, client):
        a = [await client.post("/v1/completions", json=body, headers={"x-tenant": "a"}) for _ in range(3)]
        b = await client.post("/v1/completions", json=body, headers={"x-tenant": "b"})
        anonymous = await client.post("/v1/completions", json=body)
        text = (await client.get("/metrics")).text
    assert [r.status_code for r in a] == [200, 200, 429]
    assert a[2].headers["retry-after"] == "30"  # 10 tokens short at 20/min
    assert "20 tokens per minute" in a[2].json()["error"]["message"]
    assert b.status_code == 200 and anonymous.status_code == 200
    assert 'decode_proxy:requests_shed_total{class="interactive",reason="tenant_rate"} 1.0' in text


async def test_unused_output_is_refunded(engine: FakeEngine, proxy: Any) -> None:
    policy = {"admission": {"tenantTokensPerMinute": 20}}
    body = {"model": "m", "prompt": "a b", "max_tokens": 8}
    engine.fail_status = 500  # no output at all: only the 2 prompt tokens are spent each time
    async with proxy(policy, engine.url) as (_, client):
        statuses = [(await client.post("/v1/completions", json=body, headers={"x-tenant": "t"})).status_code
                    for _ in range(6)]
    assert statuses == [500] * 6


async def test_the_charge_is_the_limit_the_engine_obeys(engine: FakeEngine, proxy: Any) -> None:
    # A completion's limit is max_tokens (neither engine reads max_completion_tokens there; a chat's is
    # max_completion_tokens when given): 2 prompt + 8 output tokens, not 2 + 1.
    policy = {"admission": {"tenantTokensPerMinute": 12}}
    body = {"model": "m", "prompt": "a b", "max_tokens": 8, "max_completion_tokens": 1}
    async with proxy(policy, engine.url) as (_, client):
        first = await client.post("/v1/completions", json=body, headers={"x-tenant": "a"})
        second = await client.post("/v1/completions", json=body, headers={"x-tenant": "a"})
    assert (first.status_code, second.status_code) == (200, 429)  # 2 of 12 left, not 9
