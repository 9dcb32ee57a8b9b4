"""`decodectl models list|pull`, run in-process through the real dispatcher (pull really uses pip)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from decodeservice.cli.main import main
from decodeservice.engine.loader import KNOWN_MODELS

SMOLLM2 = KNOWN_MODELS["smollm2-135m"]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def row(output: str, name: str) -> str:
    return next(line for line in output.splitlines() if name in line and "Known models" not in line)


def test_list_with_an_empty_cache(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "list", "--cache-dir", str(tmp_path)]) == 0
    out = capfd.readouterr().out
    assert str(tmp_path) in out
    assert "not cached" in row(out, "smollm2-135m") and "(default)" in row(out, "smollm2-135m")


@pytest.mark.model
def test_pull_list_and_heal_a_damaged_file(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "pull", "smollm2-135m", "--cache-dir", str(tmp_path)]) == 0
    out = capfd.readouterr().out
    path = Path(out.strip().splitlines()[-1])
    assert path == tmp_path / SMOLLM2.filename
    assert sha256(path) == SMOLLM2.sha256  # computed here, independently of the registry code
    assert sorted(p.name for p in tmp_path.iterdir()) == [SMOLLM2.filename]  # no wheel, no temp file

    assert main(["models", "list", "--cache-dir", str(tmp_path)]) == 0
    line = row(capfd.readouterr().out, "smollm2-135m")
    assert "cached" in line and "not cached" not in line and path.name in line and "93.8 MiB" in line

    with open(path, "r+b") as f:  # damage it: half the file is gone
        f.truncate(SMOLLM2.size // 2)
    assert main(["models", "list", "--cache-dir", str(tmp_path)]) == 0
    assert "corrupt" in row(capfd.readouterr().out, "smollm2-135m")
    assert main(["models", "pull", "smollm2-135m", "--cache-dir", str(tmp_path)]) == 0
    assert "corrupt" in capfd.readouterr().err  # it said why it pulled again
    assert sha256(path) == SMOLLM2.sha256


def test_unknown_name_is_a_usage_error(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["models", "pull", "gpt-17", "--cache-dir", str(tmp_path)])
    assert exc.value.code == 2
    err = capfd.readouterr().err
    assert "gpt-17" in err and "smollm2-135m" in err
    assert list(tmp_path.iterdir()) == []


def test_models_needs_an_action(capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["models"])
    assert exc.value.code == 2
    assert "list" in capfd.readouterr().err


def test_list_as_json(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    import json

    assert main(["models", "list", "-o", "json", "--cache-dir", str(tmp_path)]) == 0
    rows = {row["name"]: row for row in json.loads(capfd.readouterr().out)}
    row = rows["smollm2-135m"]
    assert row["default"] is True and row["status"] == "not cached" and row["path"] is None
    assert row["sha256"] == SMOLLM2.sha256 and row["size_bytes"] == SMOLLM2.size
    (tmp_path / SMOLLM2.filename).write_bytes(b"short")  # present, wrong size
    assert main(["models", "list", "-o", "json", "--cache-dir", str(tmp_path)]) == 0
    row = {r["name"]: r for r in json.loads(capfd.readouterr().out)}["smollm2-135m"]
    assert row["status"] == "corrupt" and row["path"] == str(tmp_path / SMOLLM2.filename)
