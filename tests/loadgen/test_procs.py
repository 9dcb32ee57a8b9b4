"""Child servers for the demo: readiness, failure with the log tail, and no stray processes on stop."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from decodeservice.loadgen.demo import SpecCounters, parse_spec_counters
from decodeservice.loadgen.errors import DemoError
from decodeservice.loadgen.procs import ChildServer, free_port


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_for(condition: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        os.sched_yield()


async def test_wait_ready_on_a_live_server(tmp_path: Path) -> None:
    port = free_port()
    child = ChildServer(name="http", argv=[sys.executable, "-P", "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                        url=f"http://127.0.0.1:{port}", log_path=tmp_path / "log")
    with pytest.raises(DemoError, match="exited"):  # not started yet: nothing to wait for
        await child.wait_ready(timeout_s=5)
    child.start()
    try:
        await child.wait_ready(timeout_s=30, path="/")
        assert child.pid is not None and alive(child.pid)
    finally:
        child.stop()


async def test_a_dying_child_reports_its_log_tail(tmp_path: Path) -> None:
    script = "import sys; print('error: --port must be an integer', file=sys.stderr); sys.exit(2)"
    child = ChildServer(name="engine", argv=[sys.executable, "-c", script], url=f"http://127.0.0.1:{free_port()}",
                        log_path=tmp_path / "engine.log")
    child.start()
    try:
        with pytest.raises(DemoError, match=r"(?s)engine exited \(code 2\).*--port must be an integer"):
            await child.wait_ready(timeout_s=30)
    finally:
        child.stop()


async def test_a_silent_child_times_out(tmp_path: Path) -> None:
    child = ChildServer(name="engine", argv=[sys.executable, "-c", "import time; print('loading', flush=True); time.sleep(600)"],
                        url=f"http://127.0.0.1:{free_port()}", log_path=tmp_path / "engine.log")
    child.start()
    try:
        with pytest.raises(DemoError, match=r"(?s)not ready after 1s.*loading"):
            await child.wait_ready(timeout_s=1)
    finally:
        child.stop()


def test_stop_kills_the_whole_group_even_if_sigterm_is_ignored(tmp_path: Path) -> None:
    # The child ignores SIGTERM and forks a grandchild that does too; both must be gone after stop().
    script = (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "g = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)'])\n"
        "print('GRANDCHILD=%d' % g.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    log = tmp_path / "child.log"
    child = ChildServer(name="stubborn", argv=[sys.executable, "-c", script], url="http://127.0.0.1:1",
                        log_path=log, grace_s=0.5)
    child.start()
    try:
        pid = child.pid
        assert pid is not None
        def printed() -> list[str]:  # the log's first line echoes the command, which names the marker too
            return [line for line in log.read_text().splitlines() if line.startswith("GRANDCHILD=")]

        wait_for(lambda: bool(printed()))
        grandchild = int(printed()[0].removeprefix("GRANDCHILD="))
        assert alive(grandchild)
    finally:
        child.stop()
    child.stop()  # idempotent
    assert not alive(pid)
    wait_for(lambda: not alive(grandchild))  # reaped by init once killed


def test_parse_spec_counters() -> None:
    text = (
        "# HELP vllm:spec_decode_num_drafts_total Speculative drafts verified.\n"
        "# TYPE vllm:spec_decode_num_drafts_total counter\n"
        'vllm:spec_decode_num_drafts_total{model_name="m"} 10.0\n'
        "# HELP vllm:spec_decode_num_draft_tokens_total Draft tokens.\n"
        "# TYPE vllm:spec_decode_num_draft_tokens_total counter\n"
        'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 40.0\n'
        "# HELP vllm:spec_decode_num_accepted_tokens_total Accepted.\n"
        "# TYPE vllm:spec_decode_num_accepted_tokens_total counter\n"
        'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 25.0\n'
        "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter\n"
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 9.0\n'
    )
    counters = parse_spec_counters(text)
    assert counters == SpecCounters(drafts=10, draft_tokens=40, accepted_tokens=25)
    delta = counters - SpecCounters(drafts=2, draft_tokens=8, accepted_tokens=5)
    assert delta.describe() == "62% of 32 drafted, 3.50 tok/step"  # 20/32 accepted; 1 + 20/8 per step
    assert SpecCounters().describe() == "off"
