"""A real Prometheus (Debian's package) on 127.0.0.1, with its data in a temporary folder."""

from __future__ import annotations

import contextlib
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.engine.test_server_harness import wait_until
from tests.monitoring.tools import binary


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


@contextlib.contextmanager
def running_prometheus(jobs: list[dict[str, Any]], folder: Path, *, scrape_interval: str = "1s",
                       startup_timeout: float = 30.0) -> Iterator[str]:
    """Start Prometheus scraping `jobs`; yields its base URL once it is ready, stops it at exit."""
    config = {"global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval},
              "scrape_configs": jobs}
    (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = (folder / "prometheus.log").open("wb")
    process = subprocess.Popen(
        [binary("prometheus"), f"--config.file={folder / 'prometheus.yml'}",
         f"--storage.tsdb.path={folder / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
         "--web.enable-lifecycle", "--log.level=warn"],
        stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        if process.poll() is not None:
            raise AssertionError(f"prometheus exited {process.returncode}: "
                                 f"{(folder / 'prometheus.log').read_text()[-2000:]}")
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{url}/-/ready", timeout=1.0).status_code == 200
        return False

    try:
        wait_until(ready, timeout=startup_timeout, what="prometheus to be ready", interval=0.1)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
        log.close()
