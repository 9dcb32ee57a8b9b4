"""SLO-aware admission: per-class bounded queues in front of `maxInflight` upstream slots.

A freed slot goes to the oldest `interactive` waiter first, then to `batch`. On arrival a request's
TTFT is predicted as queue wait + batching window + the recent upstream TTFT (at the SLO percentile),
where queue wait = (requests ahead + 1) x mean slot holding time / maxInflight. Requests ahead of a
`batch` request include every queued `interactive` one, so under a burst `batch` crosses the SLO first
and is shed first. A request that would wait and break `slo.ttftMs` is shed with 429 and `Retry-After`;
one that would get a slot at once is never shed (refusing it could not make anyone faster). Before the
proxy has observed any request it cannot predict, and only the queue bounds apply.
"""

from __future__ import annotations

import asyncio
import collections
import math
import time

from starlette.types import ASGIApp, Receive, Scope, Send

from decodeservice.proxy.context import get_context
from decodeservice.proxy.errors import Overloaded
from decodeservice.proxy.metrics import ProxyMetrics
from decodeservice.proxy.policy import Policy, PriorityClass

_ORDER = (PriorityClass.INTERACTIVE, PriorityClass.BATCH)


class PriorityGate:
    """`max_inflight` slots; waiters are served interactive-first, FIFO within a class."""

    def __init__(self, *, max_inflight: int, metrics: ProxyMetrics):
        self.max_inflight = max_inflight
        self.inflight = 0
        self.metrics = metrics
        self._queues: dict[PriorityClass, collections.deque[asyncio.Future[None]]] = {
            p: collections.deque() for p in PriorityClass
        }

    def depth(self, priority: PriorityClass) -> int:
        return len(self._queues[priority])

    def ahead(self, priority: PriorityClass) -> int:
        """Waiters that would be served before a newcomer of this class."""
        return sum(self.depth(p) for p in _ORDER[: _ORDER.index(priority) + 1])

    def would_wait(self, priority: PriorityClass) -> bool:
        return self.inflight >= self.max_inflight or self.ahead(priority) > 0

    async def acquire(self, priority: PriorityClass) -> None:
        if not self.would_wait(priority):
            self._set_inflight(self.inflight + 1)
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue = self._queues[priority]
        queue.append(waiter)
        self.metrics.for_class[priority].waiting.set(len(queue))
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # the slot was handed over just as the waiter went away: pass it on
            else:
                queue.remove(waiter)
            raise
        finally:
            self.metrics.for_class[priority].waiting.set(len(queue))

    def release(self) -> None:
        for priority in _ORDER:
            queue = self._queues[priority]
            while queue:
                waiter = queue.popleft()
                if not waiter.done():
                    waiter.set_result(None)  # the slot passes straight to the waiter; inflight unchanged
                    self.metrics.for_class[priority].waiting.set(len(queue))
                    return
        self._set_inflight(self.inflight - 1)

    def _set_inflight(self, value: int) -> None:
        assert 0 <= value <= self.max_inflight, value
        self.inflight = value
        self.metrics.running.set(value)


class Admission:
    def __init__(self, app: ASGIApp, *, policy: Policy, metrics: ProxyMetrics):
        self.app = app
        self.policy = policy
        self.metrics = metrics
        self.gate = PriorityGate(max_inflight=policy.admission.max_inflight, metrics=metrics)

    def predicted_wait(self, priority: PriorityClass, *, now: float) -> float | None:
        """Seconds until a newcomer of this class would get a slot; None when there is no model yet."""
        if not self.gate.would_wait(priority):
            return 0.0
        service = self.metrics.latency.mean_service_time(now=now)
        if service is None:
            return None
        return (self.gate.ahead(priority) + 1) * service / self.gate.max_inflight

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        ctx = get_context(scope)
        priority = ctx.priority
        # A request that gets a slot at once is never shed: none of the prediction runs for it.
        if self.gate.would_wait(priority):
            self._check_shed(priority)
        started = time.perf_counter()
        await self.gate.acquire(priority)
        try:
            ctx.queue_wait = time.perf_counter() - started
            self.metrics.for_class[priority].queue_time.observe(ctx.queue_wait)
            await self.app(scope, receive, send)
        finally:
            self.gate.release()

    def _check_shed(self, priority: PriorityClass) -> None:
        """Raise Overloaded when the class queue is full or the predicted TTFT breaks the objective."""
        cls = self.policy.classes.for_class(priority)
        now = time.perf_counter()
        wait = self.predicted_wait(priority, now=now)
        if self.gate.depth(priority) >= cls.max_queue:
            raise Overloaded(f"the {priority.value} queue is full ({cls.max_queue} waiting)",
                             headers={"Retry-After": str(_retry_after(wait))}, reason="queue_full")
        # The quantile sorts the recent samples: only worth it for a request that would wait.
        ttft = self.metrics.latency.ttft_quantile(self.policy.slo.percentile / 100.0, now=now) if wait else None
        if wait and ttft is not None:
            predicted = wait + cls.batch_window_ms / 1000.0 + ttft
            if predicted * 1000.0 > self.policy.slo.ttft_ms:
                raise Overloaded(
                    f"overloaded: predicted time to first token {predicted * 1000.0:.0f} ms exceeds the "
                    f"{self.policy.slo.ttft_ms:g} ms objective for {priority.value} requests",
                    headers={"Retry-After": str(_retry_after(wait))}, reason="slo",
                )


def _retry_after(wait: float | None) -> int:
    return max(1, math.ceil(wait or 0.0))
