"""The shared drain state machine: phases, in-flight counting and the waits the drain relies on."""

from __future__ import annotations

import asyncio

from decodeservice.common.lifecycle import Lifecycle, Phase


async def test_engine_path_loading_ready_draining() -> None:
    lifecycle = Lifecycle()
    lifecycle.bind(asyncio.get_running_loop())
    assert lifecycle.phase is Phase.LOADING and not lifecycle.ready
    lifecycle.mark_ready()
    assert lifecycle.ready
    waiter = asyncio.ensure_future(lifecycle.wait_for_drain_request())
    await asyncio.sleep(0)
    assert not waiter.done()
    lifecycle.request_drain()
    await asyncio.wait_for(waiter, 5)
    assert lifecycle.draining and lifecycle.drain_started is not None
    lifecycle.mark_ready()  # too late: a draining server never becomes ready again
    assert lifecycle.draining


async def test_failed_load_wakes_the_drain_waiter() -> None:
    lifecycle = Lifecycle()
    waiter = asyncio.ensure_future(lifecycle.wait_for_drain_request())
    lifecycle.mark_failed("no such file")
    await asyncio.wait_for(waiter, 5)
    assert lifecycle.phase is Phase.FAILED and lifecycle.failure == "no such file"


async def test_wait_idle_returns_when_the_last_request_leaves() -> None:
    lifecycle = Lifecycle(phase=Phase.READY)  # the proxy's start: nothing to load
    lifecycle.enter()
    with lifecycle.track():
        idle = asyncio.ensure_future(lifecycle.wait_idle(timeout=None))
        lifecycle.leave()
        await asyncio.sleep(0)
        assert lifecycle.inflight == 1 and not idle.done()
    assert await asyncio.wait_for(idle, 5) and lifecycle.inflight == 0


async def test_wait_idle_times_out_with_requests_in_flight() -> None:
    lifecycle = Lifecycle(phase=Phase.READY)
    lifecycle.enter()
    assert await lifecycle.wait_idle(timeout=0.01) is False
    assert await lifecycle.wait_idle(timeout=0) is False
