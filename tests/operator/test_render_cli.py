"""`decodectl render` as a user runs it: a subprocess, stdout YAML, exit code 2 on bad input."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from tests.operator.helpers import EXAMPLES


def decodectl(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-P", "-m", "decodeservice.cli.main", *args], input=stdin,
                          capture_output=True, text=True, timeout=60, check=False)


def test_render_prints_multi_document_manifests() -> None:
    result = decodectl("render", "-f", str(EXAMPLES / "gpu-speculative.yaml"), "--namespace", "ml")
    assert result.returncode == 0, result.stderr
    docs = list(yaml.safe_load_all(result.stdout))
    assert [d["kind"] for d in docs] == ["ConfigMap", "Service", "Deployment", "PodDisruptionBudget"]
    assert {d["metadata"]["namespace"] for d in docs} == {"ml"}


def test_render_reads_stdin() -> None:
    result = decodectl("render", "-f", "-", stdin=(EXAMPLES / "cpu-smoke.yaml").read_text())
    assert result.returncode == 0, result.stderr
    assert len(list(yaml.safe_load_all(result.stdout))) == 3


def test_render_bad_input_exits_2_with_the_reason(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: decode.dev/v1alpha1\nkind: DecodeService\nmetadata: {name: x}\n"
                   "spec: {model: {uri: 'ftp://nope'}}\n")
    result = decodectl("render", "-f", str(bad))
    assert result.returncode == 2
    assert "spec.model.uri" in result.stderr and result.stdout == ""
    missing = decodectl("render", "-f", str(tmp_path / "missing.yaml"))
    assert missing.returncode == 2 and "cannot read" in missing.stderr
    bad.write_text("a: [unclosed")
    assert decodectl("render", "-f", str(bad)).returncode == 2


def test_operator_rejects_a_bad_autoscale_interval_before_starting() -> None:
    result = decodectl("operator", "--autoscale-interval-seconds", "0")
    assert result.returncode == 2
    assert "interval_seconds must be within [0.1, 300]" in result.stderr
