"""Per-tenant token rate limit: a token bucket per `x-tenant` value, `tenantTokensPerMinute` each.

A request is charged its prompt tokens plus its output limit up front (the most it can cost), and the
unused part of the output limit is refunded when it finishes. Requests without `x-tenant` share one
anonymous bucket, so omitting the header is not a way around the limit. When the bucket is short the
request is shed with 429 and a `Retry-After` of the time the bucket needs to refill.
"""

from __future__ import annotations

import dataclasses
import math
import time

from starlette.types import ASGIApp, Receive, Scope, Send

from decodeservice.proxy.context import get_context
from decodeservice.proxy.errors import Overloaded
from decodeservice.proxy.tokens import TokenCounter, prompt_tokens

ANONYMOUS = ""


@dataclasses.dataclass(kw_only=True, slots=True)
class TokenBucket:
    capacity: float
    refill_per_second: float
    tokens: float
    updated: float

    def refill(self, now: float) -> None:
        self.tokens = min(self.capacity, self.tokens + (now - self.updated) * self.refill_per_second)
        self.updated = now

    def try_take(self, cost: float, now: float) -> float:
        """Take `cost` and return 0, or take nothing and return the seconds until it would fit."""
        self.refill(now)
        if self.tokens >= cost:
            self.tokens -= cost
            return 0.0
        return (cost - self.tokens) / self.refill_per_second

    def give_back(self, amount: float, now: float) -> None:
        self.refill(now)
        self.tokens = min(self.capacity, self.tokens + amount)


class TenantBuckets:
    def __init__(self, *, tokens_per_minute: int, max_tenants: int = 10_000):
        self.capacity = float(tokens_per_minute)
        self.rate = tokens_per_minute / 60.0
        self.max_tenants = max_tenants
        self._buckets: dict[str, TokenBucket] = {}

    def bucket(self, tenant: str, now: float) -> TokenBucket:
        bucket = self._buckets.get(tenant)
        if bucket is None:
            if len(self._buckets) >= self.max_tenants:
                self._forget_full(now)
            bucket = TokenBucket(capacity=self.capacity, refill_per_second=self.rate, tokens=self.capacity,
                                 updated=now)
            self._buckets[tenant] = bucket
        return bucket

    def _forget_full(self, now: float) -> None:
        # A bucket that has refilled to capacity is indistinguishable from a new one: dropping it loses nothing.
        full = []
        for tenant, bucket in self._buckets.items():
            bucket.refill(now)
            if bucket.tokens >= bucket.capacity:
                full.append(tenant)
        for tenant in full:
            del self._buckets[tenant]


class TenantRateLimit:
    def __init__(self, app: ASGIApp, *, tokens_per_minute: int, counter: TokenCounter):
        self.app = app
        self.buckets = TenantBuckets(tokens_per_minute=tokens_per_minute)
        self.counter = counter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        ctx = get_context(scope)
        tenant = ctx.tenant or ANONYMOUS
        output_limit = ctx.max_tokens or 0
        # A request larger than the whole bucket could never pass; it is charged one full bucket instead.
        cost = min(float(await prompt_tokens(ctx, self.counter) + output_limit), self.buckets.capacity)
        bucket = self.buckets.bucket(tenant, time.monotonic())
        wait = bucket.try_take(cost, time.monotonic())
        if wait > 0:
            raise Overloaded(
                f"tenant {tenant or '(anonymous)'} is over its limit of "
                f"{int(self.buckets.capacity)} tokens per minute; retry in {math.ceil(wait)} s",
                headers={"Retry-After": str(max(1, math.ceil(wait)))}, reason="tenant_rate",
            )
        refund = cost  # a request refused further in (shed, upstream down) is not charged at all
        try:
            await self.app(scope, receive, send)
            refund = min(float(max(0, output_limit - ctx.output_tokens)), cost)
        finally:
            bucket.give_back(refund, time.monotonic())
