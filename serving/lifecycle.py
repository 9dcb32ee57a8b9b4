"""Readiness and drain: loading -> ready -> draining, or failed.

`/ready` is 200 only in READY: a Kubernetes readiness probe takes the pod out of its Service while the
model loads and as soon as SIGTERM arrives. Draining refuses new generations (503, so a proxy retries
elsewhere) while the in-flight ones finish, up to a bounded grace period.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class Phase(enum.Enum):
    LOADING = "loading"  # weights loading, or the warm-up generation not done yet
    READY = "ready"
    DRAINING = "draining"  # SIGTERM received: no new requests, in-flight ones finish
    FAILED = "failed"  # the model could not be loaded


class Lifecycle:
    """Owned by the event loop; `request_drain` alone may be called from a signal handler."""

    def __init__(self) -> None:
        self.phase = Phase.LOADING
        self.failure: str | None = None
        self._inflight = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed: asyncio.Event | None = None
        self.drain_started: float | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Attach to the serving loop (asyncio primitives belong to one loop)."""
        self._loop = loop
        self._changed = asyncio.Event()

    @property
    def inflight(self) -> int:
        return self._inflight

    @property
    def ready(self) -> bool:
        return self.phase is Phase.READY

    def mark_ready(self) -> None:
        if self.phase is Phase.LOADING:
            self.phase = Phase.READY
        self._notify()

    def mark_failed(self, reason: str) -> None:
        self.phase = Phase.FAILED
        self.failure = reason
        self._notify()

    def request_drain(self) -> None:
        """Safe from a signal handler: the phase flips at once, waiters wake on the loop."""
        if self.phase is not Phase.DRAINING:
            self.phase = Phase.DRAINING
            self.drain_started = time.monotonic()
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._notify)

    @contextmanager
    def track(self) -> Iterator[None]:
        """Counts one in-flight generation for the drain to wait on."""
        self._inflight += 1
        try:
            yield
        finally:
            self._inflight -= 1
            self._notify()

    async def wait_for_drain_request(self) -> None:
        await self._wait(lambda: self.phase in (Phase.DRAINING, Phase.FAILED), timeout=None)

    async def wait_idle(self, timeout: float) -> bool:
        """True once nothing is in flight; False if `timeout` passed first."""
        return await self._wait(lambda: self._inflight == 0, timeout=timeout)

    async def _wait(self, condition: Callable[[], bool], *, timeout: float | None) -> bool:
        assert self._changed is not None, "bind() the lifecycle to the serving loop first"
        deadline = None if timeout is None else time.monotonic() + timeout
        while not condition():
            self._changed.clear()
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except TimeoutError:
                return condition()
        return True

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()

