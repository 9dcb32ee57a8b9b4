"""Readiness and drain, one state machine for both servers: loading -> ready -> draining, or failed.

`/ready` is 200 only in READY: a Kubernetes readiness probe takes the pod out of its Service while the
model loads and as soon as SIGTERM arrives. Draining refuses new requests (503, so a client or proxy
retries elsewhere) while the in-flight ones finish, up to a bounded grace period (`DrainingServer`).
The engine starts in LOADING; the proxy, which has nothing to load, starts in READY.
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
    """Owned by the event loop; `request_drain` alone may be called from a signal handler or thread."""

    def __init__(self, *, phase: Phase = Phase.LOADING) -> None:
        self.phase = phase
        self.failure: str | None = None
        self.drain_started: float | None = None
        self._inflight = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        # asyncio.Event binds to a loop on first wait, not here, so building this off the loop is fine.
        self._changed = asyncio.Event()

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Name the serving loop, so `request_drain` from another thread wakes waiters on it."""
        self._loop = loop

    @property
    def inflight(self) -> int:
        return self._inflight

    @property
    def ready(self) -> bool:
        return self.phase is Phase.READY

    @property
    def draining(self) -> bool:
        return self.phase is Phase.DRAINING

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
        else:
            self._notify()

    # `enter`/`leave` are the proxy's per-request hot path (no context manager frame); `track` wraps them.
    def enter(self) -> None:
        self._inflight += 1

    def leave(self) -> None:
        self._inflight -= 1
        if self._inflight == 0:
            self._notify()

    @contextmanager
    def track(self) -> Iterator[None]:
        """Counts one in-flight request for the drain to wait on."""
        self.enter()
        try:
            yield
        finally:
            self.leave()

    async def wait_for_drain_request(self) -> None:
        await self._wait(lambda: self.phase in (Phase.DRAINING, Phase.FAILED), timeout=None)

    async def wait_idle(self, timeout: float | None) -> bool:
        """True once nothing is in flight; False if `timeout` passed first."""
        return await self._wait(lambda: self._inflight == 0, timeout=timeout)

    async def _wait(self, condition: Callable[[], bool], *, timeout: float | None) -> bool:
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
        self._changed.set()
