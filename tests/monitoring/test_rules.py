"""The chart's alert rules, checked and unit-tested by `promtool` (synthetic series, see rules_test.yaml)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from decodeservice.monitoring.rules import RUNBOOK_BASE, rule_groups
from tests.monitoring.tools import binary

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
    assert "SUCCESS: 12 rules found" in result.stdout


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
