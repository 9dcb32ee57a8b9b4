"""The chart's dashboard JSON and rule file are what their sources give (scripts/generate_dashboards.py)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

from decodeservice.monitoring.panels import PANELS, ROWS, Unit, expand

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "generate_dashboards.py"


def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("generate_dashboards", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_files_are_current() -> None:
    result = subprocess.run([sys.executable, "-P", str(SCRIPT), "--check"], capture_output=True, text=True,
                            timeout=60, check=False)
    assert result.returncode == 0, result.stderr


def test_the_dashboard_holds_every_panel_with_its_queries_and_units() -> None:
    board = json.loads(generator().build_dashboard())
    rows = [p["title"] for p in board["panels"] if p["type"] == "row"]
    assert rows == [r.title for r in ROWS]
    panels = [p for p in board["panels"] if p["type"] != "row"]
    assert [p["title"] for p in panels] == [p.title for p in PANELS]
    for built, panel in zip(panels, PANELS, strict=True):
        assert built["fieldConfig"]["defaults"]["unit"] == panel.unit.value
        targets = [(t["expr"], t["legendFormat"]) for t in built["targets"]]
        assert targets == [(q.expr, q.legend) for q in panel.queries]
        assert built["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        if panel.unit is Unit.RATIO:
            assert (built["fieldConfig"]["defaults"]["min"], built["fieldConfig"]["defaults"]["max"]) == (0, 1)
    # No two panels overlap on Grafana's 24-column grid.
    cells = set()
    for p in board["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps"
                cells.add((x, y))
    names = [v["name"] for v in board["templating"]["list"]]
    assert names == ["datasource", "namespace", "service", "class"]


def test_every_query_uses_the_variables_and_expand_fills_them() -> None:
    for panel in PANELS:
        for query in panel.queries:
            assert '$namespace"' in query.expr and '$service"' in query.expr, query.expr
            assert "$" not in expand(query.expr), query.expr
            assert query.labels, f"{panel.title}: a legend with no label names no series"
