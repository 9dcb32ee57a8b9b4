"""Benchmark reports: a rich table on the terminal, and `report.json`, `report.md` and `report.png` on disk.

The PNG plots latency against output throughput, one point per load level, with TTFT and ITL on
separate panels: they are different clocks (queueing and prefill move TTFT; batch size and speculation
move ITL), and one chart would hide one behind the other.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.table import Table

from decodeservice.loadgen import metrics
from decodeservice.loadgen.metrics import Distribution, LevelSummary

CLOCKS = ("ttft", "tpot", "itl", "e2e")


@dataclass(frozen=True, kw_only=True)
class BenchReport:
    """A finished run: its settings, one summary per level, and free-form notes (warnings, acceptance)."""

    title: str
    settings: dict[str, Any]
    levels: tuple[LevelSummary, ...]
    notes: tuple[str, ...] = ()
    extra_columns: dict[str, tuple[str, ...]] = field(default_factory=dict)  # name -> one cell per level

    def to_json(self) -> dict[str, Any]:
        return {
            "title": self.title,
            "settings": self.settings,
            "levels": [dataclasses.asdict(level) for level in self.levels],
            "notes": list(self.notes),
            "extra_columns": {k: list(v) for k, v in self.extra_columns.items()},
        }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _triple(dist: Distribution) -> str:
    return f"{_ms(dist.p50)} / {_ms(dist.p90)} / {_ms(dist.p99)}"


def _goodput(level: LevelSummary) -> str:
    if level.goodput_fraction is None or level.goodput_rps is None:
        return "-"
    return f"{level.goodput_fraction:.0%} ({level.goodput_rps:.2f}/s)"


def _rows(report: BenchReport) -> tuple[list[str], list[list[str]]]:
    header = ["level", "ok/total", "req/s", "out tok/s", "TTFT ms p50/p90/p99", "TPOT ms p50/p90/p99",
              "ITL ms p50/p90/p99", "E2E ms p50/p90/p99", "goodput", *report.extra_columns]
    rows = []
    for i, level in enumerate(report.levels):
        rows.append([
            level.label, f"{level.completed}/{level.num_requests}", f"{level.request_throughput:.2f}",
            f"{level.output_throughput:.1f}", *(_triple(getattr(level, c)) for c in CLOCKS), _goodput(level),
            *(cells[i] for cells in report.extra_columns.values()),
        ])
    return header, rows


def table(report: BenchReport) -> Table:
    header, rows = _rows(report)
    out = Table(title=report.title, caption=f"SLO for goodput: {report.levels[0].slo if report.levels else '-'}")
    for name in header:
        out.add_column(name, justify="left" if name == "level" else "right")
    for row in rows:
        out.add_row(*row)
    return out


def markdown(report: BenchReport) -> str:
    header, rows = _rows(report)
    lines = [f"# {report.title}", "", "## Settings", "", "| setting | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in report.settings.items()]
    lines += ["", "## Results", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    if any(level.errors for level in report.levels):
        lines += ["", "## Errors", ""]
        lines += [f"- {level.label}: {err}" for level in report.levels for err in level.errors]
    if report.notes:
        lines += ["", "## Notes", ""] + [f"- {note}" for note in report.notes]
    definitions = (metrics.__doc__ or "").split("Definitions", 1)[-1]
    lines += ["", "## Definitions", "", "Definitions" + definitions.rstrip(), "", "![latency vs throughput](report.png)"]
    return "\n".join(lines) + "\n"


def plot(report: BenchReport, path: Path) -> None:
    """Two panels, TTFT and ITL (p50 and p99) against output tokens/s, one point per level."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt

    # Levels of one sweep form a curve; different configurations ("speculation off c=4" vs "... on c=4")
    # are separate series, never joined by a line.
    series: dict[str, list[LevelSummary]] = {}
    for level in report.levels:
        series.setdefault(level.label.rsplit(" ", 1)[0] if " " in level.label else "", []).append(level)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, clock, name in ((axes[0], "ttft", "TTFT"), (axes[1], "itl", "ITL")):
        for prefix, levels in series.items():
            xs = [level.output_throughput for level in levels]
            for pct, style in (("p50", "o-"), ("p99", "s--")):
                ys = [getattr(getattr(level, clock), pct) for level in levels]
                points = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None]
                if points:
                    ax.plot([p[0] for p in points], [p[1] for p in points], style,
                            label=f"{prefix} {name} {pct}".strip())
        for level in report.levels:
            y = getattr(level, clock).p50
            if y is not None:
                ax.annotate(level.label, (level.output_throughput, y), textcoords="offset points", xytext=(4, 4),
                            fontsize=8)
        ax.set_xlabel("output throughput (tokens/s)")
        ax.set_ylabel(f"{name} (ms)")
        ax.set_title(f"{name} vs throughput")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(report.title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(report: BenchReport, out_dir: Path) -> Sequence[Path]:
    """Write report.json, report.md and report.png into `out_dir` (created if needed).

    report.png needs matplotlib (`pip install 'decodeservice[bench]'`); without it the other two are written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = out_dir / "report.json", out_dir / "report.md", out_dir / "report.png"
    paths[0].write_text(json.dumps(report.to_json(), indent=2) + "\n", encoding="utf-8")
    paths[1].write_text(markdown(report), encoding="utf-8")
    try:
        plot(report, paths[2])
    except ModuleNotFoundError as exc:
        if exc.name != "matplotlib":
            raise
        return paths[:2]
    return paths
