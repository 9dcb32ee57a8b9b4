"""The engine process SIGKILLed mid-stream, behind the real proxy: every client gets a clean error,
later requests a clean 503, and the proxy holds nothing afterwards."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import httpx

from tests.engine.test_server_harness import MODEL, wait_until
from tests.engine.test_server_lifecycle import _read_port, _reap
from tests.proxy.conftest import running_proxy
from tests.reliability.conftest import wait_for
from tests.reliability.outcomes import Tally, request


async def test_engine_sigkilled_mid_stream(record: Callable[[Tally], dict[str, Any]]) -> None:
    cmd = [sys.executable, "-P", "-m", "decodeservice.cli.main", "engine", "--model", MODEL, "--host", "127.0.0.1",
           "--port", "0", "--kv-cache-gib", "0.05", "--max-model-len", "512", "--num-threads", "1"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = f"http://127.0.0.1:{_read_port(proc, timeout=120)}"
        wait_until(lambda: httpx.get(f"{url}/ready", timeout=10).status_code == 200, timeout=180,
                   what="the model to load", interval=0.2)
        async with running_proxy({}, url) as (app, client):
            client.timeout = httpx.Timeout(60.0)
            started: set[int] = set()
            body = {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True, "stream": True}
            streams = [asyncio.create_task(request(client, "/v1/completions", body,
                                                   on_event=lambda _, i=i: started.add(i))) for i in range(4)]
            await wait_for(lambda: len(started) == 4, timeout=60, what="four streams under way")
            proc.send_signal(signal.SIGKILL)
            tally = Tally("engine_sigkilled_mid_stream")
            cut = await asyncio.gather(*streams)
            after = await request(client, "/v1/completions", {**body, "stream": False})
            tally.add(*cut, after)
            summary = record(tally)
            assert summary["outcomes"] == {"clean_error": 5}
            assert {s.error_code for s in cut} == {"upstream_died"}
            assert after.status == 503
            await wait_for(lambda: app.state.lifecycle.inflight == 0, timeout=10, what="the proxy to let go")
            metrics = (await client.get("/metrics")).text
            assert "decode_proxy:upstream_errors_total" in metrics
    finally:
        _reap(proc)
