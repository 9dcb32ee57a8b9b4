"""`decodectl demo` end to end on the real engine and proxy, reduced in size; and Ctrl-C leaves nothing."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# Skipped only until the engine server and the proxy app exist (the coordinator removes this check then).
pytest.importorskip("decodeservice.engine.server.serve", reason="the engine server has no app yet")
if not hasattr(pytest.importorskip("decodeservice.proxy.app", reason="the proxy has no app yet"), "create_app"):
    pytest.skip("the proxy has no app yet", allow_module_level=True)

pytestmark = pytest.mark.model

DECODECTL = [sys.executable, "-c", "import sys; from decodeservice.cli.main import main; sys.exit(main())"]
ENV = {**os.environ, "COLUMNS": "200"}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_demo_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    result = subprocess.run([*DECODECTL, "demo", "--quick", "--num-requests", "2", "--max-tokens", "8",
                             "--out", str(out)], capture_output=True, text=True, timeout=600, env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    for row in ("TTFT p50", "ITL p50", "output tok/s", "goodput", "spec acceptance", "speculation on",
                "on/off, median (rounds)", "speculation on is"):
        assert row in result.stdout
    data = json.loads((out / "report.json").read_text())
    off, on = data["levels"]
    assert off["label"].startswith("speculation off") and on["label"].startswith("speculation on")
    assert off["completed"] == on["completed"] == 4  # --quick: 2 rounds of 2 requests each
    assert off["total_output_tokens"] == on["total_output_tokens"] == 32  # ignore_eos: exactly max_tokens
    assert data["extra_columns"]["spec acceptance"][0] == "off"
    verdict, reason, per_round = data["notes"][:3]
    assert verdict.startswith("speculation on is") and "median of 2 rounds" in verdict
    assert len(per_round.split(":")[1].split(",")) == 2
    assert "drafts landed" in reason or "speculation stays off" in reason or "no request drafted" in reason
    assert (out / "report.png").read_bytes()[:4] == b"\x89PNG" and (out / "report.md").exists()
    pids = [int(p) for p in data["settings"]["pids"].split()]
    assert len(pids) == 4 and not any(alive(p) for p in pids)  # two engines, a proxy each: all stopped


def sigint_as_a_terminal_leaves_it() -> None:
    # A shell without job control starts a background job (`bash .ci/run &` inside a script) with SIGINT
    # ignored, every descendant inherits that, and Python then installs no KeyboardInterrupt handler: the
    # demo rightly ignores the signal there. Ctrl-C in a terminal finds SIGINT at its default; so does this.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_stops_every_child(tmp_path: Path) -> None:
    proc = subprocess.Popen([*DECODECTL, "demo", "--quick", "--out", str(tmp_path / "demo")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV,
                            preexec_fn=sigint_as_a_terminal_leaves_it)
    assert proc.stderr is not None
    pids: list[int] = []
    deadline = time.monotonic() + 300
    try:
        # Wait for the stop word: the engine has started (and printed its pid).
        while not pids:
            assert time.monotonic() < deadline, "the demo never started the engine"
            ready, _, _ = select.select([proc.stderr], [], [], 5.0)
            line = proc.stderr.readline() if ready else ""
            assert line or proc.poll() is None, "the demo exited early"
            if line.startswith("started engine"):
                pids.append(int(line.split("(pid ")[1].split(")")[0]))
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
    assert not alive(pids[0])
