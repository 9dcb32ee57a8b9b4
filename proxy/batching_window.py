"""Batching window: hold arrivals of a class until its window closes or `maxBatch` are waiting.

The first arrival opens a group and starts a `batchWindowMs` timer; the group is released together
when the timer fires or when it reaches `maxBatch`, so the engine sees them in one step and fills its
prefill batch. It sits inside admission (after the upstream slot is taken), so a released group goes to
the engine at once. A window of 0 (or `maxBatch: 1`) passes requests straight through, which is what
`interactive` traffic usually wants. Every request's hold time is observed, zeros included.
"""

from __future__ import annotations

import asyncio
import time

from starlette.types import ASGIApp, Receive, Scope, Send

from decodeservice.proxy.context import get_context
from decodeservice.proxy.metrics import ProxyMetrics
from decodeservice.proxy.policy import ClassesPolicy, PriorityClass


class _Group:
    def __init__(self) -> None:
        self.members = 0
        self.released = asyncio.Event()
        self.timer: asyncio.TimerHandle | None = None


class BatchingWindow:
    def __init__(self, app: ASGIApp, *, classes: ClassesPolicy, metrics: ProxyMetrics):
        self.app = app
        self.classes = classes
        self.metrics = metrics
        self._open: dict[PriorityClass, _Group] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        ctx = get_context(scope)
        priority = ctx.priority
        cls = self.classes.for_class(priority)
        if cls.batch_window_ms > 0 and cls.max_batch > 1:
            ctx.window_hold = await self._hold(priority, window=cls.batch_window_ms / 1000.0,
                                               max_batch=cls.max_batch)
        self.metrics.for_class[priority].window_hold.observe(ctx.window_hold)
        await self.app(scope, receive, send)

    def held(self, priority: PriorityClass) -> int:
        """Requests of this class held right now."""
        group = self._open.get(priority)
        return group.members if group is not None else 0

    async def _hold(self, priority: PriorityClass, *, window: float, max_batch: int) -> float:
        started = time.perf_counter()
        group = self._open.get(priority)
        if group is None:
            group = _Group()
            self._open[priority] = group
            group.timer = asyncio.get_running_loop().call_later(window, self._release, priority, group)
        group.members += 1
        held = self.metrics.for_class[priority].held
        held.inc()
        if group.members >= max_batch:
            self._release(priority, group)
        try:
            await group.released.wait()
        except asyncio.CancelledError:
            group.members -= 1  # a client that left while held no longer counts toward maxBatch
            raise
        finally:
            held.dec()
        return time.perf_counter() - started

    def _release(self, priority: PriorityClass, group: _Group) -> None:
        if self._open.get(priority) is group:
            del self._open[priority]
        if group.timer is not None:
            group.timer.cancel()
        group.released.set()
