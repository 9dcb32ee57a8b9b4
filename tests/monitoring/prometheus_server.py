"""A real Prometheus (Debian's package) on 127.0.0.1 for the tests: monitoring/local_prometheus.py, the one
the demo runs too, skipped with the reason where the binary is missing (failed on CI)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from decodeservice.monitoring.local_prometheus import LocalPrometheus, free_port, static_job
from tests.monitoring.tools import binary

__all__ = ["free_port", "running_prometheus", "static_job"]


@contextlib.contextmanager
def running_prometheus(jobs: list[dict[str, Any]], folder: Path, *, scrape_interval_s: float = 1.0,
                       startup_timeout_s: float = 30.0) -> Iterator[str]:
    """Start Prometheus scraping `jobs`; yields its base URL once it is ready, stops it at exit."""
    with LocalPrometheus(binary=binary("prometheus"), jobs=jobs, folder=folder, scrape_interval_s=scrape_interval_s,
                         startup_timeout_s=startup_timeout_s) as prometheus:
        yield prometheus.url
