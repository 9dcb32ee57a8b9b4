"""A real Prometheus on 127.0.0.1 with its data in a folder of ours: `decodectl demo`'s view and the tests.

It runs the `prometheus` binary found on PATH (Debian's `prometheus` package), scraping static targets
whose labels stand in for what Kubernetes discovery and the chart's PodMonitor give the pods' series
(`namespace`, `service`, `pod`), so the dashboard's queries (monitoring/panels.py) select them unchanged.
It runs in its own session, so a terminal's Ctrl-C reaches only its parent, which stops it.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import yaml

from decodeservice.monitoring.prometheus import PrometheusError


def find_binary() -> str | None:
    """Where the `prometheus` server is, or None (Debian: apt-get install prometheus)."""
    return shutil.which("prometheus")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def static_job(name: str, url: str, labels: dict[str, str], *, honor_labels: bool = False,
               relabel_configs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A scrape job for one target: `labels` may carry Kubernetes discovery's `__meta_*` labels, which
    `relabel_configs` turn into target labels as in a cluster."""
    host = url.removeprefix("http://").rstrip("/")
    return {"job_name": name, "honor_labels": honor_labels, "metrics_path": "/metrics",
            "static_configs": [{"targets": [host], "labels": labels}],
            "relabel_configs": relabel_configs or []}


class LocalPrometheus:
    """One Prometheus process: `start()` returns once it is ready, `stop()` (safe twice) ends it."""

    def __init__(self, *, binary: str, jobs: list[dict[str, Any]], folder: Path, scrape_interval_s: float = 1.0,
                 startup_timeout_s: float = 30.0) -> None:
        if scrape_interval_s <= 0 or startup_timeout_s <= 0 or not jobs:
            raise ValueError("LocalPrometheus needs jobs, a positive scrape interval and a positive timeout")
        self.binary, self.jobs, self.folder = binary, jobs, folder
        self.scrape_interval_s, self.startup_timeout_s = scrape_interval_s, startup_timeout_s
        self.url = ""
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def log_path(self) -> Path:
        return self.folder / "prometheus.log"

    def __enter__(self) -> LocalPrometheus:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> str:
        interval = f"{self.scrape_interval_s:g}s"
        config = {"global": {"scrape_interval": interval, "evaluation_interval": interval},
                  "scrape_configs": self.jobs}
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / "prometheus.yml").write_text(yaml.safe_dump(config))
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        with self.log_path.open("wb") as log:
            self._process = subprocess.Popen(
                [self.binary, f"--config.file={self.folder / 'prometheus.yml'}",
                 f"--storage.tsdb.path={self.folder / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
                 "--log.level=warn"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._wait(self._ready, timeout_s=self.startup_timeout_s, what="to be ready")
        except BaseException:
            self.stop()
            raise
        return self.url

    def _tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def _ready(self) -> bool:
        if self._process is None or self._process.poll() is not None:
            code = None if self._process is None else self._process.returncode
            raise PrometheusError(f"prometheus exited (code {code}); {self.log_path} ends with:\n{self._tail()}")
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{self.url}/-/ready", timeout=1.0).status_code == 200
        return False

    def _wait(self, condition: Callable[[], bool], *, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            if time.monotonic() > deadline:
                raise PrometheusError(f"prometheus at {self.url} did not {what} within {timeout_s:.0f}s; "
                                      f"{self.log_path} ends with:\n{self._tail()}")
            time.sleep(0.1)  # a poll of a child process, not a test's wait

    def instant(self, expr: str) -> list[dict[str, Any]]:
        response = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=5.0)
        body = response.json()
        if body.get("status") != "success":
            raise PrometheusError(f"{expr}: {body.get('error', body)}")
        return list(body["data"]["result"])

    def wait_scraped(self, *, after: float, timeout_s: float = 30.0) -> None:
        """Until every target has been scraped (successfully) at a time later than `after` (unix seconds),
        so the rates Prometheus computes hold every increment counted before `after`."""

        def scraped() -> bool:
            with contextlib.suppress(httpx.HTTPError):
                # timestamp() reads a sample's own time only straight off a selector: `and` keeps it.
                up = self.instant("timestamp(up) and up == 1")
                return len(up) == len(self.jobs) and all(float(s["value"][1]) > after for s in up)
            return False

        self._wait(scraped, timeout_s=timeout_s, what=f"scrape its {len(self.jobs)} target(s)")

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
