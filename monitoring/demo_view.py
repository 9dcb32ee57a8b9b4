"""`decodectl demo`'s dashboard: a Prometheus of the demo's own scrapes its proxies, and at the end the
dashboard's panels are drawn to dashboard.png from it (monitoring/png.py), as `decodectl dashboard` draws
them from a cluster's Prometheus.

A proxy's /metrics carries its own `decode_proxy:*` series and relays its engine's `vllm:*` ones, so one
target per proxy holds both, as the chart's PodMonitor scrapes one port per pod. Each target carries the
labels the PodMonitor's relabelling and the Prometheus Operator give a pod's series (`namespace`,
`service`, `pod`), one service per proxy (the demo's engines with speculation off and on are two, side
by side in every panel), so the dashboard's queries select them unchanged. Panels fed only by the
operator (replicas) or by a router have nothing to show here and are left out; speculation acceptance,
which the demo compares, is drawn beside the main panels.

Without the `prometheus` binary (Debian: apt-get install prometheus) or matplotlib the demo says so and
draws nothing; every other step of the demo runs as before.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Mapping
from pathlib import Path

from rich.console import Console

from decodeservice.monitoring import png
from decodeservice.monitoring.local_prometheus import LocalPrometheus, find_binary, static_job
from decodeservice.monitoring.panels import MAIN_PANELS, SPECULATION, Panel, Source
from decodeservice.monitoring.prometheus import PrometheusClient, PrometheusError, TimeRange

NAMESPACE, SERVICE = "local", "demo"  # the labels a cluster's series carry; the demo has no cluster
SCRAPE_INTERVAL_S = 1.0
# Four scrape intervals is Grafana's floor for a rate; 15 s keeps the two runs' lines apart yet smooth.
RATE_INTERVAL_S = 15
_POINTS = 240  # samples per line, whatever the demo's length
LOCAL_SOURCES = frozenset({Source.PROXY, Source.ENGINE})
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")  # a label value the dashboard's regexes take as is


def local_panels(sources: frozenset[Source] = LOCAL_SOURCES) -> tuple[Panel, ...]:
    """The main panels (and speculation acceptance) that the processes in `sources` feed."""
    return tuple(p for p in (*MAIN_PANELS, SPECULATION) if any(q.source in sources for q in p.queries))


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Picture:
    path: Path
    panels: tuple[png.PanelData, ...]

    @property
    def empty(self) -> tuple[str, ...]:
        return tuple(d.panel.title for d in self.panels if not d.lines)


@dataclasses.dataclass(kw_only=True)
class DemoView:
    """Start with `watch()` once the proxy is ready, `draw()` after the runs, `close()` in `finally`."""

    console: Console = dataclasses.field(default_factory=lambda: Console(stderr=True))
    binary: str | None = dataclasses.field(default_factory=find_binary)  # None: not installed
    out: Path | None = None
    prometheus: LocalPrometheus | None = None
    services: tuple[str, ...] = ()
    started: float = 0.0

    def watch(self, *, out: Path, proxy_url: str | None = None, services: Mapping[str, str] | None = None,
              console: Console | None = None) -> None:
        """Start the Prometheus on the demo's proxies and wait for its first scrape, so the first requests'
        counts are rises: `proxy_url` is the service "demo"; `services` names one service per proxy URL
        (speculation off and on, drawn side by side)."""
        self.console = console or self.console
        self.out = out
        targets = {**(services or {}), **({SERVICE: proxy_url} if proxy_url is not None else {})}
        if not targets or not all(_NAME.match(name) for name in targets):
            raise ValueError(f"DemoView.watch needs proxies named like Kubernetes objects, got {sorted(targets)}")
        binary = self.binary
        if binary is None:
            self.console.print("[yellow]prometheus is not installed (Debian: apt-get install prometheus): "
                               "the demo runs without its dashboard picture[/]")
            return
        self.services = tuple(targets)
        jobs = [static_job(f"decodeservice-pods-{name}", url, {"namespace": NAMESPACE, "service": name,
                                                              "pod": f"{name}-0", "component": "engine"})
                for name, url in targets.items()]
        prometheus = LocalPrometheus(binary=binary, jobs=jobs, folder=out / "prometheus",
                                     scrape_interval_s=SCRAPE_INTERVAL_S)
        try:
            prometheus.start()
            self.prometheus = prometheus
            self.started = time.time()
            prometheus.wait_scraped(after=self.started - 60)
        except PrometheusError as exc:
            prometheus.stop()
            self.prometheus = None
            self.console.print(f"[yellow]no dashboard picture: {exc}[/]")
            return
        self.console.print(f"started prometheus on {prometheus.url} (scraping every {SCRAPE_INTERVAL_S:g}s, "
                           f"data in {prometheus.folder})")

    def render(self, sources: frozenset[Source] = LOCAL_SOURCES) -> Picture | None:
        """Draw the panels from everything scraped so far; None (and a message) where nothing can be drawn."""
        if self.prometheus is None or self.out is None:
            return None
        path = self.out / "dashboard.png"
        try:
            self.prometheus.wait_scraped(after=time.time())  # the last increments are in
            end = time.time()
            step = max(1.0, round((end - self.started) / _POINTS))
            # Steps count back from now, so the last one falls after that scrape, not up to a step before it.
            window = TimeRange(start=end - math.ceil((end - self.started) / step) * step, end=end, step=step)
            view = png.View(window=window, namespace=NAMESPACE, service="|".join(self.services),
                            rate_interval_s=RATE_INTERVAL_S)
            with PrometheusClient(self.prometheus.url) as client:
                data = png.render(client, view, path, panels=local_panels(sources))
        except PrometheusError as exc:
            self.console.print(f"[yellow]no dashboard picture: {exc}[/]")
            return None
        except ModuleNotFoundError as exc:
            if exc.name != "matplotlib":
                raise
            self.console.print("[yellow]no dashboard picture: drawing needs matplotlib "
                               "(pip install 'decodeservice[bench]')[/]")
            return None
        picture = Picture(path=path, panels=tuple(data))
        missing = f"; no data: {', '.join(picture.empty)}" if picture.empty else ""
        self.console.print(f"dashboard: {path} ({len(data)} panels from the demo's Prometheus{missing})")
        return picture

    def draw(self) -> list[Path]:
        """The demo's hook: the PNG's path, or nothing where it could not be drawn (said already)."""
        picture = self.render()
        return [] if picture is None else [picture.path]

    def close(self) -> None:
        if self.prometheus is not None:
            self.prometheus.stop()
            self.prometheus = None
