"""Failure and shutdown: an engine-loop crash, and SIGTERM draining a real `decodectl engine` process."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import httpx

from decodeservice.engine import Engine, EngineConfig
from decodeservice.engine.outputs import RequestOutput
from tests.conftest import ModelBundle
from tests.engine.test_server_harness import MODEL, running_server, wait_until


class CrashingEngine(Engine):
    """Fault injection by subclassing: the step after `healthy_steps` raises."""

    def __init__(self, *, healthy_steps: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.healthy_steps = healthy_steps
        self.steps = 0

    def step(self) -> list[RequestOutput]:
        self.steps += 1
        if self.steps > self.healthy_steps:
            raise RuntimeError("injected fault: the GPU fell off the bus")
        return super().step()


def test_engine_crash_gives_clean_errors_and_unhealthy(bundled: ModelBundle) -> None:
    def factory() -> Engine:
        # 1 step for the warm-up, then 3 for the request below before the fault.
        return CrashingEngine(healthy_steps=4, model=bundled.model, tokenizer=bundled.tokenizer,
                              config=EngineConfig(kv_cache_gib=0.25, max_model_len=2048))

    with running_server(factory) as srv, srv.client(timeout=60) as http:
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 50, "ignore_eos": True, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "engine_dead" and error["type"] == "server_error"
        assert "injected fault" in error["message"]
        assert all("choices" in json.loads(e) for e in events[:-2])  # tokens before the fault, then the error

        health = http.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "dead"
        assert http.get("/ready").status_code == 503
        after = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        assert after.status_code == 500
        assert after.json()["error"]["code"] == "engine_dead"


def test_not_ready_until_loaded_and_warm(bundled: ModelBundle) -> None:
    loaded = threading.Event()

    def slow_factory() -> Engine:
        assert loaded.wait(60), "the test never released the load"
        return bundled.engine(kv_cache_gib=0.25, max_model_len=2048)

    with running_server(slow_factory, wait_ready=False) as srv, srv.client(timeout=60) as http:
        ready = http.get("/ready")
        assert ready.status_code == 503 and ready.json()["status"] == "loading"
        assert http.get("/health").json()["status"] == "loading"
        refused = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "not_ready"
        loaded.set()
        srv.wait_ready()
        # Ready means warm: the warm-up generation has already gone through the engine.
        assert srv.aengine.stats().generation_tokens >= 1
        assert http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1}).status_code == 200


def _reap(proc: subprocess.Popen[str]) -> None:
    """End a server subprocess a test started, whatever state the test left it in, and free its pipe."""
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    if proc.stderr is not None:
        proc.stderr.close()


def _read_port(proc: subprocess.Popen[str], timeout: float) -> int:
    """Wait for uvicorn's stop words on stderr; they carry the bound port."""
    assert proc.stderr is not None
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stderr], [], [], max(deadline - time.monotonic(), 0))
        if not ready:
            break
        line = proc.stderr.readline()
        if not line:
            break
        seen.append(line)
        match = re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", line)
        if match:
            return int(match.group(1))
    proc.kill()
    raise AssertionError(f"the server never listened; its log:\n{''.join(seen)}")


def test_sigterm_drains_then_exits_zero() -> None:
    cmd = [sys.executable, "-P", "-m", "decodeservice.cli.main", "engine", "--model", MODEL, "--host", "127.0.0.1",
           "--port", "0", "--kv-cache-gib", "0.25", "--max-model-len", "2048", "--num-threads", "2",
           "--drain-timeout-seconds", "120"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        port = _read_port(proc, timeout=120)
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: httpx.get(f"{url}/ready", timeout=10).status_code == 200, timeout=180,
                   what="the model to load", interval=0.2)

        first_chunk = threading.Event()
        result: dict[str, Any] = {}

        def stream() -> None:
            body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 24, "ignore_eos": True,
                    "stream": True}
            events = []
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        first_chunk.set()
            result["events"] = events

        streamer = threading.Thread(target=stream)
        streamer.start()
        assert first_chunk.wait(120), "the stream never started"
        proc.send_signal(signal.SIGTERM)

        # At once: not ready, and new work is refused so a proxy sends it elsewhere.
        wait_until(lambda: httpx.get(f"{url}/ready", timeout=10).status_code == 503, timeout=5,
                   what="/ready to turn 503")
        refused = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=10)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"

        streamer.join(timeout=120)
        assert not streamer.is_alive()
        events = result["events"]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # the stream finished, not cut off
        assert proc.wait(timeout=60) == 0
    finally:
        _reap(proc)
