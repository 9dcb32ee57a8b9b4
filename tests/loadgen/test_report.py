"""Report files: JSON with every figure, Markdown with definitions and errors, a PNG, a rich table."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console

from decodeservice.loadgen import report
from decodeservice.loadgen.metrics import RequestRecord, Slo, summarize


def level(label: str, gap: float, *, failed: int = 0) -> report.LevelSummary:
    records = [RequestRecord(start=i, end=i + 0.1 + 3 * gap, chunk_times=tuple(i + 0.1 + k * gap for k in range(4)),
                             output_tokens=4) for i in range(5)]
    records += [RequestRecord(start=0, end=0.01, error="HTTP 503: not ready")] * failed
    return summarize(records, label=label, slo=Slo(itl_ms=30))


def test_write_reports(tmp_path: Path) -> None:
    rep = report.BenchReport(title="t", settings={"url": "http://x"}, notes=("a note",),
                             levels=(level("c=1", 0.02), level("c=4", 0.05, failed=1)))
    paths = report.write(rep, tmp_path / "new")
    assert [p.name for p in paths] == ["report.json", "report.md", "report.png"]
    data = json.loads(paths[0].read_text())
    first, second = data["levels"]
    assert first["goodput_fraction"] == 1.0 and second["goodput_fraction"] == 0.0
    assert second["failed"] == 1 and second["errors"] == ["HTTP 503: not ready"]
    assert abs(first["itl"]["p50"] - 20.0) < 1e-6 and first["itl"]["count"] == 15
    md = paths[1].read_text()
    assert "## Errors" in md and "c=4: HTTP 503: not ready" in md and "a note" in md
    assert "**TPOT**" in md and "**Goodput**" in md
    png = paths[2].read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    console = Console(record=True, width=250)
    console.print(report.table(rep))
    text = console.export_text()
    assert "c=4" in text and "5/6" in text and "100% (" in text and "itl<=30ms" in text
