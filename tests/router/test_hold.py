"""Scale from zero: a request at zero ready endpoints is held, answered once one is ready, and
refused with 503 + Retry-After past `--hold-seconds` or `--max-held`."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx

from decodeservice.loadgen.procs import decodectl, free_port
from tests.router.conftest import chat, metric, running_router, wait_until

ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def process(argv: list[str]) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()
        assert proc.stderr is not None
        proc.stderr.close()


async def wait_for_http(url: str, *, timeout: float = 20.0) -> None:
    async with httpx.AsyncClient(timeout=1.0) as client:
        async def up() -> bool:
            try:
                return (await client.get(url)).status_code == 200
            except httpx.HTTPError:
                return False

        deadline = asyncio.get_running_loop().time() + timeout
        while not await up():
            assert asyncio.get_running_loop().time() < deadline, f"{url} did not come up"
            await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def router_process(*args: str) -> AsyncIterator[tuple[str, subprocess.Popen[bytes]]]:
    """`decodectl router ARGS` as its own process on a free port: its URL and the process."""
    port = free_port()
    with process(decodectl("router", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
                           *args)) as proc:
        url = f"http://127.0.0.1:{port}"
        await wait_for_http(url + "/health")
        yield url, proc


async def test_a_request_at_zero_endpoints_is_held_until_one_is_ready() -> None:
    engine_port = free_port()  # nothing listens there yet: connections are refused
    async with router_process("--endpoints", f"http://127.0.0.1:{engine_port}", "--hold-seconds", "60",
                              "--scrape-interval-seconds", "0.2") as (router, _), \
            httpx.AsyncClient(base_url=router, timeout=60.0) as client:
        assert (await client.get("/ready")).status_code == 200  # ready with no endpoint: it holds
        pending = asyncio.create_task(client.post("/v1/chat/completions", json=chat("wake up")))

        async def held() -> float:
            return metric((await client.get("/metrics")).text, "decode_router:requests_held",
                          **{"class": "interactive"})

        while await held() != 1:
            assert not pending.done(), pending.result().text
            await asyncio.sleep(0.05)
        text = (await client.get("/metrics")).text
        assert metric(text, "decode_router:last_request_timestamp_seconds") > 0
        assert metric(text, "decode_router:endpoints", state="ready") == 0
        with process([sys.executable, "-P", "tests/support/fake_engine.py", "--port", str(engine_port)]):
            response = await asyncio.wait_for(pending, 30)
            assert response.status_code == 200
            assert response.content.endswith(b"data: [DONE]\n\n")
            assert await held() == 0


async def test_past_the_hold_a_503_with_retry_after() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    async with running_router([dead], wait_ready=0, hold_seconds=0.3) as (app, client):
        response = await client.post("/v1/chat/completions", json=chat("anyone?"))
        assert response.status_code == 503
        assert response.headers["retry-after"] == "1"
        assert response.json()["error"]["code"] == "no_ready_endpoint"
        text = (await client.get("/metrics")).text
        assert metric(text, "decode_router:requests_shed_total", **{"class": "interactive", "reason": "hold_timeout"}) == 1
        assert metric(text, "decode_router:requests_total", status="503") == 1


async def test_more_than_max_held_get_a_503_at_once() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    async with running_router([dead], wait_ready=0, hold_seconds=30, max_held=1) as (app, client):
        first = asyncio.create_task(client.post("/v1/completions", json={"prompt": "a"}, headers={"x-priority": "batch"}))
        await wait_until(lambda: app.state.dispatcher.held == 1)
        second = await client.post("/v1/completions", json={"prompt": "b"}, headers={"x-priority": "batch"})
        assert second.status_code == 503 and "retry-after" in second.headers
        text = (await client.get("/metrics")).text
        assert metric(text, "decode_router:requests_shed_total", **{"class": "batch", "reason": "hold_full"}) == 1
        assert metric(text, "decode_router:requests_held", **{"class": "batch"}) == 1
        first.cancel()  # the client leaves while held: counted as 499, and no longer held
        with contextlib.suppress(asyncio.CancelledError):
            await first
        await wait_until(lambda: app.state.dispatcher.held == 0)
        await wait_until(lambda: metric(app.state.metrics.render(ready=0, known=1).decode(),
                                        "decode_router:requests_total", status="499") == 1)
