"""Load generation: a closed-loop concurrency level, or open-loop seeded Poisson arrivals.

- Concurrency C: C workers each send their next request as soon as the previous one ends (a closed
  loop; the server's speed sets the arrival rate).
- Rate R: requests are sent at Poisson arrival times (exponential gaps of mean 1/R seconds, from a
  seeded generator, so a run can be repeated exactly), whether or not earlier ones have finished (an
  open loop; queueing shows up as growing TTFT).

`run_level` is the one load generator of the project: `decodectl bench` runs it with the JSON-parsing
`client.send`, and `benchmarks/proxy_overhead.py` with a lighter sender and a kept-alive client of its
own (`sender=`, `client=`).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import httpx

from decodeservice.loadgen.client import BenchRequest, send
from decodeservice.loadgen.errors import BenchConfigError
from decodeservice.loadgen.metrics import RequestRecord


@dataclass(frozen=True, kw_only=True)
class LoadLevel:
    """One point of a sweep: `concurrency` workers, or Poisson arrivals at `rate` req/s."""

    kind: Literal["concurrency", "rate"]
    value: float

    def __post_init__(self) -> None:
        if self.kind == "concurrency" and (self.value < 1 or self.value != int(self.value)):
            raise BenchConfigError(f"concurrency must be a positive integer, got {self.value:g}")
        if self.kind == "rate" and not self.value > 0:
            raise BenchConfigError(f"rate must be positive req/s, got {self.value:g}")

    @property
    def label(self) -> str:
        return f"c={int(self.value)}" if self.kind == "concurrency" else f"rate={self.value:g}/s"


def parse_concurrency(text: str) -> tuple[LoadLevel, ...]:
    """`1,4,16` -> three concurrency levels, in the given order."""
    levels = []
    for part in text.split(","):
        try:
            value = int(part.strip())
        except ValueError:
            raise BenchConfigError(f"--concurrency {text!r}: {part.strip()!r} is not an integer") from None
        levels.append(LoadLevel(kind="concurrency", value=value))
    return tuple(levels)


def poisson_schedule(count: int, *, rate: float, seed: int) -> list[float]:
    """Send offsets in seconds from the start: cumulative exponential gaps of mean 1/rate.

    The first request goes at its first gap, not at 0, so every gap follows the same distribution.
    """
    if count < 0 or not rate > 0:
        raise BenchConfigError("need count >= 0 and rate > 0")
    rng = random.Random(seed)
    offsets, now = [], 0.0
    for _ in range(count):
        now += rng.expovariate(rate)
        offsets.append(now)
    return offsets


ProgressFn = Callable[[RequestRecord], None]
# Sends one request over the client and times it; failures are recorded in the record, not raised.
Sender = Callable[[httpx.AsyncClient, BenchRequest], Awaitable[RequestRecord]]


async def run_level(
    *,
    url: str,
    model: str,
    requests: Sequence[BenchRequest],
    level: LoadLevel,
    seed: int = 0,
    on_done: ProgressFn | None = None,
    timeout_s: float = 600.0,
    client: httpx.AsyncClient | None = None,
    sender: Sender | None = None,
) -> list[RequestRecord]:
    """Send `requests` at `level` and return their records in request order.

    `client`: reuse its (kept-alive) connections instead of opening a client for this level; it stays
    open. `sender`: how one request is sent and timed (default: `client.send`, which parses each chunk).
    """
    width = int(level.value) if level.kind == "concurrency" else len(requests)
    records: list[RequestRecord | None] = [None] * len(requests)

    async def default_sender(http: httpx.AsyncClient, request: BenchRequest) -> RequestRecord:
        return await send(http, url=url, model=model, request=request)

    send_one = sender or default_sender
    async with contextlib.AsyncExitStack() as stack:
        if client is None:
            # Enough pooled connections that the client never queues requests the server could take.
            limits = httpx.Limits(max_connections=max(1, width), max_keepalive_connections=max(1, width))
            client = await stack.enter_async_context(
                httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s, connect=10.0)))
        http = client

        async def one(index: int) -> None:
            record = await send_one(http, requests[index])
            records[index] = record
            if on_done is not None:
                on_done(record)

        if level.kind == "concurrency":
            queue = iter(range(len(requests)))  # shared: each worker takes the next index when free

            async def worker() -> None:
                for index in queue:
                    await one(index)

            await asyncio.gather(*(worker() for _ in range(min(width, len(requests)))))
        else:
            start = time.perf_counter()
            tasks = []
            for index, offset in enumerate(poisson_schedule(len(requests), rate=level.value, seed=seed)):
                delay = start + offset - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(index)))
            await asyncio.gather(*tasks)
    assert all(r is not None for r in records)
    return [r for r in records if r is not None]
