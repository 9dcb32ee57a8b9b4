"""`decodectl dashboard`: draw the Grafana dashboard's main panels to a PNG from a Prometheus.

The same queries as the dashboard the chart ships (monitoring/panels.py), answered by Prometheus's
HTTP API, so a laptop run shows the cluster's view. Needs matplotlib (`decodeservice[bench]`).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

from decodeservice.cli.common import UsageError, subcommand_kwargs

_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")  # Kubernetes object names: no regex metacharacters
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_POINTS = 120  # samples per line: a readable plot at any --since


def parse_duration(text: str) -> float:
    match = _DURATION.match(text.strip())
    if match is None or float(match.group(1)) <= 0:
        raise UsageError(f"--since must be a positive duration like 90s, 15m, 6h or 2d, got {text!r}")
    return float(match.group(1)) * _UNITS[match.group(2)]


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "dashboard", help="draw the dashboard's main panels to a PNG from a Prometheus",
        description=__doc__, **subcommand_kwargs())
    parser.add_argument("--prometheus", required=True, metavar="URL", help="Prometheus base URL, e.g. "
                        "http://127.0.0.1:9090")
    parser.add_argument("--service", default=None, metavar="NAME", help="one DecodeService (default: all)")
    parser.add_argument("--namespace", default=None, metavar="NS", help="its namespace (default: all)")
    parser.add_argument("--since", default="15m", help="how far back to draw (default 15m)")
    parser.add_argument("-o", "--output", type=Path, default=Path("dashboard.png"),
                        help="PNG to write (default ./dashboard.png)")
    parser.set_defaults(func=run)


def _name(flag: str, value: str | None) -> str:
    if value is None:
        return ".+"
    if not _NAME.match(value):
        raise UsageError(f"{flag} must be a Kubernetes name (lowercase letters, digits, '-', '.'), got {value!r}")
    return value


def run(args: argparse.Namespace) -> int:
    import time

    from decodeservice.monitoring.png import View, render
    from decodeservice.monitoring.prometheus import PrometheusClient, PrometheusError, TimeRange

    if not args.prometheus.startswith(("http://", "https://")):
        raise UsageError(f"--prometheus must be an http(s) URL, got {args.prometheus!r}")
    since = parse_duration(args.since)
    end = time.time()
    window = TimeRange(start=end - since, end=end, step=max(1.0, round(since / _POINTS)))
    view = View(window=window, namespace=_name("--namespace", args.namespace),
                service=_name("--service", args.service))
    try:
        with PrometheusClient(args.prometheus) as client:
            data = render(client, view, args.output)
    except PrometheusError as exc:
        raise UsageError(str(exc)) from None
    except ModuleNotFoundError as exc:
        if exc.name != "matplotlib":
            raise
        raise UsageError("drawing needs matplotlib: pip install 'decodeservice[bench]'") from None
    empty = [d.panel.title for d in data if not d.lines]
    print(f"wrote {args.output} ({len(data)} panels{'; no data: ' + ', '.join(empty) if empty else ''})")
    return 0
