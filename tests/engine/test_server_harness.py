"""Shared harness for the engine server tests: the real app on a real uvicorn on 127.0.0.1:0.

No tests live here; the server test modules import `running_server` and the helpers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from decodeservice.engine import AsyncEngine, Engine
from decodeservice.engine.server.serve import EngineServer, make_server
from decodeservice.engine.server.settings import ServerSettings

MODEL = "smollm2-135m"


def wait_until(condition: Callable[[], bool], *, timeout: float, what: str, interval: float = 0.02) -> None:
    """Poll a condition until it holds; fail with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    pause = threading.Event()  # never set: a bounded wait between polls
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        pause.wait(interval)


@dataclass
class RunningServer:
    server: EngineServer
    url: str

    @property
    def aengine(self) -> AsyncEngine:
        aengine = self.server.state.aengine
        assert aengine is not None
        return aengine

    def wait_ready(self) -> None:
        wait_until(lambda: httpx.get(f"{self.url}/ready", timeout=30).status_code == 200, timeout=180,
                   what="/ready", interval=0.1)

    def client(self, timeout: float = 120.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout)

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample of /metrics, keyed by (sample name, sorted labels)."""
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def sample(self, name: str, **labels: str) -> float:
        key = (name, tuple(sorted({"model_name": MODEL, **labels}.items())))
        return self.metrics().get(key, 0.0)


@contextmanager
def running_server(engine_factory: Callable[[], Engine], *, wait_ready: bool = True,
                   **settings: object) -> Iterator[RunningServer]:
    """Serve in a background thread (uvicorn installs no signal handlers off the main thread)."""
    server = make_server(ServerSettings(served_model_name=MODEL, **settings),  # type: ignore[arg-type]
                         engine_factory=engine_factory, host="127.0.0.1", port=0, log_level="warning")
    thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started or not thread.is_alive(), timeout=60, what="uvicorn to listen")
        assert server.started, "uvicorn did not start"
        port = server.servers[0].sockets[0].getsockname()[1]
        running = RunningServer(server=server, url=f"http://127.0.0.1:{port}")
        if wait_ready:
            running.wait_ready()
        yield running
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        assert not thread.is_alive(), "the server thread did not stop"
