"""`decodectl proxy` as a real process: bad policy exits 2; SIGTERM drains and exits 0."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from decodeservice.cli.main import main
from tests.support.fake_engine import FakeEngine


def test_bad_policy_file_exits_2_with_a_clear_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text("outputLength:\n  maxOutputTokens: 0\n  mood: clamp\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["proxy", "--upstream", "http://127.0.0.1:1", "--policy", str(policy)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "outputLength.maxOutputTokens: Input should be greater than or equal to 1" in err
    assert "outputLength.mood: unknown field" in err


@pytest.mark.parametrize("argv, message", [
    (["--upstream", "127.0.0.1:8001"], "--upstream must be an http(s) URL"),
    (["--upstream", "http://x", "--policy", "/nonexistent/policy.yaml"], "cannot read policy file"),
    (["--upstream", "http://x", "--tokenizer", "/nonexistent/tokenizer.json"], "no such file"),
    (["--upstream", "http://x", "--upstream-health-path", "health"], "--upstream-health-path: upstream health path"),
    (["--upstream", "http://x", "--engine-kind", "sglang"], "invalid choice: 'sglang'"),
])
def test_bad_arguments_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["proxy", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def _wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient() as client:
        while True:
            assert proc.poll() is None, "proxy process exited early"
            try:
                if (await client.get(url + "/health")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "proxy did not come up"
            await asyncio.sleep(0.05)


async def test_sigterm_drains_in_flight_streams_and_exits_0(engine: FakeEngine, tmp_path: Path) -> None:
    engine.itl_s = 0.05
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    policy = tmp_path / "policy.yaml"
    policy.write_text("admission: {maxInflight: 4}\n")
    proc = subprocess.Popen(
        [sys.executable, "-P", "-m", "decodeservice.cli.main", "proxy", "--upstream", engine.url, "--port", str(port),
         "--policy", str(policy), "--log-level", "warning"],
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        await _wait_healthy(url, proc)
        async with httpx.AsyncClient(base_url=url, timeout=10.0) as client:
            body = {"model": "m", "prompt": "x", "max_tokens": 20, "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as stream:
                lines = stream.aiter_lines()
                await anext(line async for line in lines if line.startswith("data: "))
                proc.send_signal(signal.SIGTERM)
                # The same keep-alive pool opens a second connection: the listener is still up.
                async with httpx.AsyncClient(base_url=url, timeout=5.0) as other:
                    deadline = time.monotonic() + 5.0
                    while True:
                        refused = await other.post("/v1/completions", json={"prompt": "x"})
                        if refused.status_code == 503:
                            break
                        assert time.monotonic() < deadline, "draining never started"
                        await asyncio.sleep(0.01)
                    assert refused.json()["error"]["code"] == "draining"
                    assert refused.headers["retry-after"] == "1"
                    assert (await other.get("/ready")).status_code == 503
                rest = [line async for line in lines]
        assert rest[-2:] == ["data: [DONE]", ""] or rest[-1] == "data: [DONE]"
        assert engine.completed == 1 and engine.cancelled == 0
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
