"""Fixtures: the fake engine (tests/support/fake_engine.py) in its own process, so its timing does not
share our event loop."""

from __future__ import annotations

import select
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

FAKE = Path(__file__).parents[1] / "support" / "fake_engine.py"


def start_fake(*flags: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, str(FAKE), *flags], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    # Wait for the stop word, bounded: the server prints its port once it is listening.
    ready, _, _ = select.select([proc.stdout], [], [], 30.0)
    line = proc.stdout.readline() if ready else ""
    if not line.startswith("PORT "):
        proc.kill()
        proc.wait()
        raise RuntimeError(f"fake server did not start: {line!r}")
    return proc, f"http://127.0.0.1:{int(line.split()[1])}"


@pytest.fixture
def fake_server() -> Iterator[Callable[..., str]]:
    """`fake_server("--ttft", "0.1", "--itl", "0.02")` -> base URL; every server is stopped afterwards."""
    procs: list[subprocess.Popen[str]] = []

    def start(*flags: str) -> str:
        proc, url = start_fake(*flags)
        procs.append(proc)
        return url

    yield start
    for proc in procs:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
