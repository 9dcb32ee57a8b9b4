"""Child servers for the demo: start in their own process group, wait until ready, always stop.

Each child runs in a new session (its own process group), so a terminal's Ctrl-C reaches only the
demo, which then stops every child in `finally`: SIGTERM to the whole group, SIGKILL after a grace
period. Nothing the child forked (tokenizer threads, worker processes) outlives the demo.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import httpx

from decodeservice.loadgen.errors import DemoError


def free_port() -> int:
    """A port the OS considers free right now (the child binds it a moment later)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def decodectl(*args: str) -> list[str]:
    """`decodectl ARGS` with this interpreter, so the demo works from a venv that is not on PATH."""
    return [sys.executable, "-P", "-m", "decodeservice.cli.main", *args]


class ChildServer:
    """One child HTTP server with its output in a log file."""

    def __init__(self, *, name: str, argv: Sequence[str], url: str, log_path: Path, grace_s: float = 10.0,
                 env: Mapping[str, str] | None = None) -> None:
        self.name = name
        self.argv = list(argv)
        self.env = dict(env) if env is not None else None  # added to this process's environment
        self.url = url
        self.log_path = log_path
        self.grace_s = grace_s
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            log.write(f"$ {' '.join(self.argv)}\n".encode())
            log.flush()
            env = {**os.environ, **self.env} if self.env is not None else None
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True, env=env)

    def tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.rstrip().splitlines()[-lines:])

    def last_line(self) -> str:
        return self.tail(1).strip()[-100:]

    async def wait_ready(self, *, timeout_s: float, on_tick: Callable[[], None] | None = None,
                         path: str = "/ready") -> None:
        """Poll GET `path` until 200; fail with the log tail if the child exits or time runs out."""
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(timeout=httpx.Timeout(5.0)) as client:
            while True:
                if self.proc is None or self.proc.poll() is not None:
                    code = None if self.proc is None else self.proc.returncode
                    raise DemoError(f"{self.name} exited (code {code}) before it was ready; its log "
                                    f"({self.log_path}) ends with:\n{self.tail()}")
                try:
                    if (await client.get(f"{self.url}{path}")).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass  # not listening yet
                if time.monotonic() > deadline:
                    raise DemoError(f"{self.name} was not ready after {timeout_s:.0f}s; its log "
                                    f"({self.log_path}) ends with:\n{self.tail()}")
                if on_tick is not None:
                    on_tick()
                await asyncio.sleep(0.5)

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL it after the grace period; safe to call twice."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            self._signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(timeout=self.grace_s)
            except subprocess.TimeoutExpired:
                pass
        # The leader may be gone while something it forked lingers in the group: kill the group anyway.
        self._signal_group(proc, signal.SIGKILL)
        proc.wait()

    @staticmethod
    def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
        try:
            os.killpg(proc.pid, sig)  # start_new_session: the group id is the child's pid
        except (ProcessLookupError, PermissionError):
            pass
