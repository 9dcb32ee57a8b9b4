"""`decodectl dashboard`'s bad input: a message and exit code 2 (the drawing itself: test_prometheus_e2e.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from decodeservice.cli.dashboard_cmd import parse_duration
from decodeservice.cli.main import UsageError
from tests.monitoring.prometheus_server import free_port


def decodectl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-P", "-m", "decodeservice.cli.main", "dashboard", *args],
                          capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.parametrize(("args", "message"), [
    (["--prometheus", "127.0.0.1:9090"], "--prometheus must be an http(s) URL"),
    (["--prometheus", "http://127.0.0.1:9", "--since", "15x"], "--since must be a positive duration"),
    (["--prometheus", "http://127.0.0.1:9", "--service", "a|b"], "--service must be a Kubernetes name"),
    ([], "the following arguments are required: --prometheus"),
])
def test_bad_flags_exit_2_with_a_message(args: list[str], message: str) -> None:
    result = decodectl(*args)
    assert result.returncode == 2
    assert message in result.stderr


def test_an_unreachable_prometheus_is_reported(tmp_path: Path) -> None:
    out = tmp_path / "d.png"
    result = decodectl("--prometheus", f"http://127.0.0.1:{free_port()}", "-o", str(out))
    assert result.returncode == 2
    assert "cannot reach Prometheus" in result.stderr
    assert not out.exists()


def test_durations() -> None:
    assert parse_duration("90s") == 90 and parse_duration("15m") == 900 and parse_duration("2d") == 172800
    with pytest.raises(UsageError):
        parse_duration("0m")
