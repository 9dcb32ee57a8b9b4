"""The dashboard's main panels drawn to a PNG from Prometheus, without Grafana (`decodectl dashboard`).

The queries are the Grafana dashboard's own (monitoring/panels.py) with its variables filled in, so the
picture and the dashboard agree. matplotlib comes with the `bench` extra and is imported only here.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import re
from collections.abc import Sequence
from pathlib import Path

from decodeservice.monitoring.panels import MAIN_PANELS, Panel, Unit, expand
from decodeservice.monitoring.prometheus import PrometheusClient, Series, TimeRange

_PLACEHOLDER = re.compile(r"\{\{\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\}\}")
_MAX_LINES = 12  # a panel with more series keeps the first ones (sorted by legend) and says so


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PanelData:
    panel: Panel
    lines: tuple[tuple[str, Series], ...]  # (legend, series)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class View:
    """What to draw: which services, over which window."""

    window: TimeRange
    namespace: str = ".+"
    service: str = ".+"
    rate_interval_s: int | None = None  # None: from the step, for a cluster's 15s scrapes

    @property
    def rate_interval(self) -> str:
        if self.rate_interval_s is not None:  # a Prometheus of our own scraping every second (the demo)
            return f"{self.rate_interval_s}s"
        # Grafana's $__rate_interval is at least four scrape intervals; step-based here, never under 1m of
        # a 15s scrape, so a rate always has samples to work with.
        return f"{max(60, int(self.window.step * 4))}s"


def legend(fmt: str, labels: dict[str, str]) -> str:
    return _PLACEHOLDER.sub(lambda m: labels.get(m.group(1), ""), fmt).strip()


def fetch(client: PrometheusClient, view: View, panels: Sequence[Panel] = MAIN_PANELS) -> list[PanelData]:
    out = []
    for panel in panels:
        lines: list[tuple[str, Series]] = []
        for query in panel.queries:
            expr = expand(query.expr, namespace=view.namespace, service=view.service,
                          rate_interval=view.rate_interval)
            lines += [(legend(query.legend, s.labels), s) for s in client.query_range(expr, view.window)
                      if s.has_numbers()]
        out.append(PanelData(panel=panel, lines=tuple(sorted(lines, key=lambda line: line[0]))))
    return out


def _scale(unit: Unit) -> tuple[float, str]:
    return {Unit.RATIO: (100.0, "%"), Unit.SECONDS: (1000.0, "ms"), Unit.PER_SECOND: (1.0, "req/s")}.get(
        unit, (1.0, ""))


def draw(data: Sequence[PanelData], path: Path, *, title: str, window: TimeRange | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt

    cols = 3
    rows = math.ceil(len(data) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.0 * cols, 4.8 * rows), squeeze=False)
    for ax, item in zip(axes.flat, data, strict=False):
        factor, suffix = _scale(item.panel.unit)
        ax.set_title(item.panel.title, fontsize=11, loc="left")
        shown = item.lines[:_MAX_LINES]
        for name, series in shown:
            times = [datetime.datetime.fromtimestamp(t) for t in series.times]
            values = [v * factor for v in series.values]
            # A line of one or two points draws nothing visible: mark its points.
            sparse = sum(math.isfinite(v) for v in values) < 3
            ax.plot(times, values, label=name, linewidth=1.3, marker="o" if sparse else None, markersize=3)
        if not shown:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey")
        else:
            more = f" (+{len(item.lines) - len(shown)} more)" if len(item.lines) > len(shown) else ""
            # Below the plot, not on it: a legend inside hides the lines it names.
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(0.0, -0.14), ncol=2, frameon=False,
                      title=more or None, title_fontsize=7)
        if item.panel.unit is Unit.RATIO:
            ax.set_ylim(0, 105)
        else:  # every panel is a rate, a count or a latency: from 0, so a flat line reads as its level
            peak = max((v for _, s in shown for v in s.values if math.isfinite(v)), default=0.0)
            ax.set_ylim(bottom=0, top=None if peak > 0 else 1)
        ax.set_ylabel(suffix)
        if window is not None:  # every panel on the same time axis, as in Grafana
            ax.set_xlim(datetime.datetime.fromtimestamp(window.start), datetime.datetime.fromtimestamp(window.end))
        # minticks 3: with the default 5 beside maxticks, some spans (3 min) find no interval and warn.
        locator = mdates.AutoDateLocator(minticks=3, maxticks=7)  # type: ignore[no-untyped-call]
        ax.xaxis.set_major_locator(locator)
        ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator))  # type: ignore[no-untyped-call]
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(data):]:
        ax.axis("off")
    fig.suptitle(title, fontsize=13)
    fig.tight_layout(rect=(0.0, 0.0, 1.0, 0.97))  # the top 3% for the title, clear of the first row's titles
    fig.savefig(path, dpi=90)
    plt.close(fig)


def render(client: PrometheusClient, view: View, path: Path,
           panels: Sequence[Panel] = MAIN_PANELS) -> list[PanelData]:
    """Query every panel (the main ones by default) and write the PNG; returns what was drawn."""
    data = fetch(client, view, panels)
    start = datetime.datetime.fromtimestamp(view.window.start).strftime("%Y-%m-%d %H:%M")
    who = "every DecodeService" if view.service == ".+" else view.service
    draw(data, path, title=f"DecodeService: {who}, from {start} ({int(view.window.end - view.window.start)} s)",
         window=view.window)
    return data
