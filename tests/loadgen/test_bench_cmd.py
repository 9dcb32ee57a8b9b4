"""`decodectl bench` end to end against the fake server, and its handling of bad input (exit code 2)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from decodeservice.cli.main import main

# Like the `decodectl` script: `-m decodeservice.cli.main` would load the module twice (as __main__).
DECODECTL = [sys.executable, "-c", "import sys; from decodeservice.cli.main import main; sys.exit(main())"]


def bench(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*DECODECTL, "bench", *argv],
                          capture_output=True, text=True, timeout=120)


def test_sweep_writes_reports(fake_server: Callable[..., str], tmp_path: Path) -> None:
    url = fake_server("--ttft", "0.1", "--itl", "0.01")
    out = tmp_path / "out"
    result = bench("--url", url, "--dataset", "chat", "--concurrency", "1,4", "--num-requests", "8",
                   "--max-tokens", "uniform:4:8", "--slo", "ttft=1000,itl=200", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "c=1" in result.stdout and "c=4" in result.stdout and "TTFT" in result.stdout
    assert "warning" not in result.stderr  # 16 of 300 prompts: no repeats
    data = json.loads((out / "report.json").read_text())
    assert data["settings"]["model"] == "fake-model"  # the first of GET /v1/models
    assert [lvl["label"] for lvl in data["levels"]] == ["c=1", "c=4"]
    for level in data["levels"]:
        assert level["completed"] == 8 and level["goodput_fraction"] == 1.0
        assert 4 * 8 <= level["total_output_tokens"] <= 8 * 8
        assert 100 <= level["ttft"]["p50"] < 1000  # never faster than the server's 100 ms; accuracy: test_accuracy
    # Four workers finish the same work faster than one (ideally 4x; loopback overhead on a busy machine).
    assert data["levels"][1]["request_throughput"] > 2 * data["levels"][0]["request_throughput"]
    md = (out / "report.md").read_text()
    assert "TPOT" in md and "(e2e - TTFT) / (output_tokens - 1)" in md and "| c=4 |" in md
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_rate_mode_and_prefix_cache_warning(fake_server: Callable[..., str], tmp_path: Path) -> None:
    url = fake_server("--ttft", "0.01", "--itl", "0.005")
    dataset = tmp_path / "tiny.jsonl"
    dataset.write_text("\n".join(json.dumps({"id": str(i), "prompt": f"p{i}"}) for i in range(3)) + "\n")
    result = bench("--url", url + "/v1", "--dataset", str(dataset), "--concurrency", "1,2", "--num-requests", "3",
                   "--max-tokens", "4", "--out", str(tmp_path / "a"))
    assert result.returncode == 0, result.stderr
    assert "warning" in result.stderr and "prefix caching" in result.stderr
    assert "prefix caching" in (tmp_path / "a" / "report.md").read_text()
    result = bench("--url", url, "--dataset", "mixed", "--rate", "50", "--seed", "3", "--num-requests", "5",
                   "--max-tokens", "dataset:6", "--out", str(tmp_path / "b"))
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "b" / "report.json").read_text())["levels"][0]["label"] == "rate=50/s"


@pytest.mark.parametrize(("argv", "message"), [
    (["--concurrency", "0"], "concurrency"),
    (["--concurrency", "1,x"], "not an integer"),
    (["--rate", "fast"], "not a number"),
    (["--rate", "-1"], "rate must be positive"),
    (["--slo", "ttft=1,latency=3"], "bad SLO term"),
    (["--max-tokens", "uniform:8"], "--max-tokens"),
    (["--num-requests", "0"], "num-requests"),
    (["--dataset", "no-such-dataset"], "neither a shipped dataset"),
    (["--url", "127.0.0.1:8000"], "http://"),
])
def test_bad_input_exits_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    full = ["bench", "--url", "http://127.0.0.1:9", *argv]
    with pytest.raises(SystemExit) as exc:
        main(full)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_argparse_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["bench"], ["bench", "--url", "http://x", "--rate", "1", "--concurrency", "2"]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2


def test_unreachable_server_is_a_clear_error(tmp_path: Path) -> None:
    result = bench("--url", "http://127.0.0.1:9", "--num-requests", "1", "--out", str(tmp_path))
    assert result.returncode == 2
    assert "cannot reach http://127.0.0.1:9" in result.stderr and "Traceback" not in result.stderr


def test_model_flag_on_a_server_without_a_model_list(fake_server: Callable[..., str], tmp_path: Path) -> None:
    url = fake_server("--ttft", "0.01", "--itl", "0.005", "--no-models")
    result = bench("--url", url, "--num-requests", "2", "--max-tokens", "3", "--out", str(tmp_path))
    assert result.returncode == 2 and "/v1/models answered HTTP 404" in result.stderr
    result = bench("--url", url, "--model", "mine", "--num-requests", "2", "--max-tokens", "3", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "report.json").read_text())["settings"]["model"] == "mine"
