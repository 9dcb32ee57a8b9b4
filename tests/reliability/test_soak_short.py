"""A very short soak (CI): mixed traffic with disconnects through the proxy to the real engine, both in
this process. Nothing lost, counters agree, and the proxy's asyncio tasks, this process's open fds and
the engine's blocks return to their idle values. The long run with RSS slopes and a plot is
`benchmarks/reliability.py soak`."""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import Callable
from typing import Any

from tests.engine.test_server_harness import RunningServer
from tests.reliability.conftest import assert_engine_idle, stack, wait_for
from tests.reliability.outcomes import Tally, request, scrape, total

SECONDS = float(os.environ.get("RELIABILITY_SOAK_SECONDS", "12"))


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_short_soak(engine_srv: RunningServer, record: Callable[[Tally], dict[str, Any]]) -> None:
    async with stack(engine_srv, {"admission": {"isolatePrefixCache": True}}) as s:
        await request(s.client, "/v1/completions", {"prompt": "warm", "max_tokens": 2})  # pool connections
        tasks_before, fds_before = len(asyncio.all_tasks()), _open_fds()
        proxy_before, engine_before = scrape(await s.proxy_metrics()), engine_srv.metrics()
        tally = Tally("short_soak")
        deadline = time.monotonic() + SECONDS

        async def worker(i: int) -> None:
            rnd = random.Random(i)
            while time.monotonic() < deadline:
                chat = rnd.random() < 0.5
                body: dict[str, Any] = {"max_tokens": rnd.randint(2, 12), "stream": rnd.random() < 0.7,
                                        "temperature": 0.7}
                body.update({"messages": [{"role": "user", "content": "Hi"}]} if chat else {"prompt": "Hello"})
                leave = 2 if body["stream"] and rnd.random() < 0.25 else None
                tally.add(await request(s.client, "/v1/chat/completions" if chat else "/v1/completions", body,
                                        headers={"x-tenant": f"t{i}"}, stop_after_chunks=leave))

        await asyncio.gather(*(worker(i) for i in range(3)))
        await assert_engine_idle(engine_srv)
        summary = record(tally)
        assert summary["lost"] == 0 and summary["tried"] >= 3
        full, left = summary["outcomes"].get("full", 0), summary["outcomes"].get("disconnected", 0)
        proxy_after, engine_after = scrape(await s.proxy_metrics()), engine_srv.metrics()
        def delta(after: Any, before: Any, name: str, **labels: str) -> float:
            return total(after, name, **labels) - total(before, name, **labels)

        assert delta(proxy_after, proxy_before, "decode_proxy:requests_total") == summary["tried"]
        aborted = delta(engine_after, engine_before, "vllm:request_success_total", finished_reason="abort")
        finished = delta(engine_after, engine_before, "vllm:request_success_total") - aborted
        # Both sides agree exactly; a client that left after its last token is a 200 and finished on both.
        assert delta(proxy_after, proxy_before, "decode_proxy:requests_total", status="200") == finished
        assert delta(proxy_after, proxy_before, "decode_proxy:requests_total", status="499") == aborted
        assert full <= finished <= full + left and finished + aborted == full + left
        # Back to where it started: no task outlives its request, and the fds are at most the kept-alive
        # pools (client->proxy and proxy->engine, both ends in this process: 4 per worker), where a leak
        # per request would be dozens.
        await wait_for(lambda: len(asyncio.all_tasks()) <= tasks_before and _open_fds() <= fds_before + 4 * 3,
                       timeout=10, what=f"tasks {len(asyncio.all_tasks())}/{tasks_before}, "
                                        f"fds {_open_fds()}/{fds_before}")
