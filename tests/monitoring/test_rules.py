"""The chart's alert rules, checked and unit-tested by `promtool` (synthetic series, see rules_test.yaml)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import helm_python
import pytest
import yaml

from decodeservice.monitoring.rules import RUNBOOK_BASE, rule_groups
from tests.monitoring.tools import binary
from tests.operator.helpers import CHART

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
RULES = ROOT / "charts" / "decodeservice-operator" / "files" / "rules.yaml"
TROUBLESHOOTING = ROOT / "docs" / "troubleshooting.md"


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([binary("promtool"), *args], capture_output=True, text=True, timeout=60, check=False,
                          cwd=HERE)


def test_promtool_checks_the_rules() -> None:
    result = _promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 18 rules found" in result.stdout


def test_promtool_unit_tests_pass() -> None:
    # Fast burn pages within its windows, slow burn tickets, capacity alerts fire; "healthy" fires nothing
    # (each alert_rule_test lists every alert of its name at that time).
    result = _promtool("test", "rules", "rules_test.yaml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_promtool_unit_tests_can_fail(tmp_path: Path) -> None:
    # Guards the guard: a rule file whose fast burn threshold is off makes the same unit tests fail.
    broken = RULES.read_text().replace("> 14.4", "> 20")
    assert broken != RULES.read_text()
    (tmp_path / "rules.yaml").write_text(broken)
    tests = yaml.safe_load((HERE / "rules_test.yaml").read_text())
    tests["rule_files"] = [str(tmp_path / "rules.yaml")]
    (tmp_path / "rules_test.yaml").write_text(yaml.safe_dump(tests))
    result = _promtool("test", "rules", str(tmp_path / "rules_test.yaml"))
    assert result.returncode != 0
    assert "DecodeServiceSLOFastBurn" in result.stdout + result.stderr


def _unit_tests_against(rules: dict[str, Any], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rules))
    tests = yaml.safe_load((HERE / "rules_test.yaml").read_text())
    tests["rule_files"] = [str(tmp_path / "rules.yaml")]
    (tmp_path / "rules_test.yaml").write_text(yaml.safe_dump(tests))
    return _promtool("test", "rules", str(tmp_path / "rules_test.yaml"))


@pytest.mark.parametrize("min_requests", [None, 0])
def test_the_charts_minimum_traffic_value_reaches_the_alerts(min_requests: int | None, tmp_path: Path) -> None:
    # The chart's own PrometheusRule passes the unit tests with the default minimum; set to 0 (the condition
    # off), "trickle" and "quiet" page on a handful of requests and the same tests fail.
    rules: dict[str, Any] = {"enabled": True}
    if min_requests is not None:
        rules["minRequests"] = min_requests
    with helm_python.Chart.load(CHART) as chart:
        rendered = chart.render(values={"monitoring": {"rules": rules}}, name="dso", namespace="ops",
                                is_install=True)
    docs = [d for path, text in rendered.items() if path.endswith(".yaml") for d in yaml.safe_load_all(text) if d]
    spec = next(d for d in docs if d["kind"] == "PrometheusRule")["spec"]
    result = _unit_tests_against(spec, tmp_path)
    if min_requests is None:
        assert result.returncode == 0, result.stdout + result.stderr
        return
    assert result.returncode != 0
    assert "DecodeServiceSLOFastBurn" in result.stdout + result.stderr
    assert 'service="trickle"' in result.stdout + result.stderr or "service: trickle" in result.stdout + result.stderr


def test_every_runbook_link_has_its_section() -> None:
    anchors = set()
    for line in TROUBLESHOOTING.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add("".join(c for c in title.replace(" ", "-") if c.isalnum() or c in "-_"))
    links = {rule["annotations"]["runbook_url"] for group in rule_groups()["groups"] for rule in group["rules"]
             if "alert" in rule}
    assert len(links) == 4
    for link in links:
        base, anchor = link.split("#")
        assert base == RUNBOOK_BASE
        assert anchor in anchors, f"docs/troubleshooting.md has no section #{anchor}"
