"""The alert rules, as one Prometheus rule file keyed by labels: one set serves every DecodeService.

Burn-rate alerting as in the Google SRE workbook ("Alerting on SLOs", multiwindow, multi-burn-rate):
the error ratio of each objective over a long and a short window, both above a multiple of the error
budget. The budget comes from the proxies' own `decode_proxy:slo_target_ratio` (slo.percentile / 100),
and the error ratio from their `decode_proxy:slo_requests_total{outcome}` counters, so no rule names a
service or a target. scripts/generate_dashboards.py writes the file into the chart
(charts/decodeservice-operator/files/rules.yaml), which wraps it in a PrometheusRule.

A burn needs traffic to mean anything: with one request in a window, its one miss is an error ratio of
1, a burn of 20x on a 95% target. So each window of a pair must also hold at least `slo_min_requests`
requests judged against the objective; the threshold is a recording rule (a constant, as Sloth records
its objectives) so the chart can set it (`monitoring.rules.minRequests`) without touching any alert.
"""

from __future__ import annotations

import dataclasses
from typing import Any

RUNBOOK_BASE = "https://github.com/decodeservice/decodeservice/blob/main/docs/troubleshooting.md"
# Recording-rule names follow the level:metric:operations convention.
ERROR_RATIO = "decodeservice:slo_error_ratio:rate{window}"
REQUESTS = "decodeservice:slo_requests:increase{window}"
BUDGET = "decodeservice:slo_error_budget"
MIN_REQUESTS = "decodeservice:slo_min_requests"
# Below 10 requests a single miss moves a window's error ratio by more than 0.1, which is itself a page
# (14.4x) on a 99% target; at 10 or more it takes two misses in ten, a real pattern, to page there.
DEFAULT_MIN_REQUESTS = 10
_BY = "namespace, service, class, objective"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class BurnWindow:
    """Alert when the error ratio over both windows exceeds `factor` times the budget."""

    long: str
    short: str
    factor: float


# The workbook's table for a 30-day budget: 2% of it in 1 h pages, 5% in 6 h and 10% in 3 d ticket.
FAST = (BurnWindow(long="1h", short="5m", factor=14.4),)
SLOW = (BurnWindow(long="6h", short="30m", factor=6.0), BurnWindow(long="3d", short="6h", factor=1.0))


def _seconds(window: str) -> int:
    units = {"m": 60, "h": 3600, "d": 86400}
    return int(window[:-1]) * units[window[-1]]


WINDOWS = tuple(sorted({w for b in FAST + SLOW for w in (b.long, b.short)}, key=_seconds))


def runbook(anchor: str) -> str:
    return f"{RUNBOOK_BASE}#{anchor}"


def _recording_rules() -> list[dict[str, Any]]:
    rules: list[dict[str, Any]] = [{
        "record": BUDGET,
        # Every pod of a service reads one policy; max keeps the series while pods roll.
        "expr": "1 - max by (namespace, service) (decode_proxy:slo_target_ratio)",
    }, {
        # The chart's monitoring.rules.minRequests replaces the number (templates/monitoring-rules.yaml).
        "record": MIN_REQUESTS,
        "expr": f"vector({DEFAULT_MIN_REQUESTS})",
    }]
    for window in WINDOWS:
        missed = (f'sum by ({_BY}) (rate(decode_proxy:slo_requests_total{{objective=~"ttft|itl", '
                  f'outcome="missed"}}[{window}]))')
        total = f'sum by ({_BY}) (rate(decode_proxy:slo_requests_total{{objective=~"ttft|itl"}}[{window}]))'
        rules.append({"record": ERROR_RATIO.format(window=window), "expr": f"{missed} / {total}"})
        judged = f'sum by ({_BY}) (increase(decode_proxy:slo_requests_total{{objective=~"ttft|itl"}}[{window}]))'
        rules.append({"record": REQUESTS.format(window=window), "expr": judged})
    return rules


def _burn(b: BurnWindow) -> str:
    def over(window: str) -> str:
        # The burn rate: how many times faster than the budget allows the errors come.
        return f"{ERROR_RATIO.format(window=window)} / on (namespace, service) group_left {BUDGET} > {b.factor:g}"

    def busy(window: str) -> str:
        return f"{REQUESTS.format(window=window)} >= on () group_left {MIN_REQUESTS}"
    # The value stays the long window's burn rate (the left-most operand), which the description prints.
    return (f"(\n  {over(b.long)}\n  and {over(b.short)}\n  and on ({_BY}) {busy(b.long)}"
            f"\n  and on ({_BY}) {busy(b.short)}\n)")


def _burn_alert(name: str, windows: tuple[BurnWindow, ...], *, severity: str, for_: str,
                speed: str) -> dict[str, Any]:
    expr = "\nor\n".join(_burn(b) for b in windows)
    pairs = ", ".join(f"{b.long}/{b.short} at {b.factor:g}x" for b in windows)
    return {
        "alert": name, "expr": expr, "for": for_, "labels": {"severity": severity},
        "annotations": {
            "summary": f"{{{{ $labels.namespace }}}}/{{{{ $labels.service }}}}: {speed} burn of the "
                       f"{{{{ $labels.objective }}}} error budget ({{{{ $labels.class }}}})",
            "description": f"The {{{{ $labels.objective }}}} objective of class {{{{ $labels.class }}}} burns "
                           f"its error budget (1 - slo.percentile) {{{{ $value | printf \"%.1f\" }}}}x as fast as "
                           f"a 30-day budget allows (thresholds: {pairs}).",
            "runbook_url": runbook("slo-burn-rate-alerts"),
        },
    }


def _alerts() -> list[dict[str, Any]]:
    op = "namespace, name"
    return [
        _burn_alert("DecodeServiceSLOFastBurn", FAST, severity="page", for_="2m", speed="fast"),
        _burn_alert("DecodeServiceSLOSlowBurn", SLOW, severity="ticket", for_="15m", speed="slow"),
        {
            "alert": "DecodeServiceReplicasBelowDesired",
            "expr": (f'max by ({op}) (decodeservice_replicas{{state="ready"}}) < '
                     f'max by ({op}) (decodeservice_replicas{{state="desired"}})'),
            "for": "15m", "labels": {"severity": "ticket"},
            "annotations": {
                "summary": "{{ $labels.namespace }}/{{ $labels.name }}: ready replicas below desired for 15m",
                "description": "{{ $value }} replicas ready, fewer than desired: new pods are pending, "
                               "pulling, loading the model or failing readiness.",
                "runbook_url": runbook("replicas-stuck-below-desired"),
            },
        },
        {
            "alert": "DecodeServiceEngineNotReady",
            "expr": (f'max by ({op}) (decodeservice_replicas{{state="desired"}}) > 0 and '
                     f'max by ({op}) (decodeservice_replicas{{state="ready"}}) == 0'),
            "for": "10m", "labels": {"severity": "page"},
            "annotations": {
                "summary": "{{ $labels.namespace }}/{{ $labels.name }}: no replica ready for 10m",
                "description": "Replicas are wanted but no pod passes readiness (the proxy's /ready asks "
                               "its engine): nothing can serve.",
                "runbook_url": runbook("engine-not-ready"),
            },
        },
        {
            "alert": "DecodeServiceEngineUnreachable",
            "expr": ('sum by (namespace, service, pod) '
                     '(rate(decode_proxy:upstream_errors_total{kind="unreachable"}[5m])) > 0'),
            "for": "5m", "labels": {"severity": "page"},
            "annotations": {
                "summary": "{{ $labels.namespace }}/{{ $labels.pod }}: the proxy cannot reach its engine",
                "description": "The proxy's connections to the engine in its pod are refused: the engine "
                               "died or restarts.",
                "runbook_url": runbook("engine-not-ready"),
            },
        },
        {
            "alert": "DecodeServiceShedding",
            "expr": ('sum by (namespace, service, class) (rate({__name__=~"decode_proxy:requests_shed_total|'
                     'decode_router:requests_shed_total"}[10m]))\n  / on (namespace, service, class) '
                     'sum by (namespace, service, class) (rate(decode_proxy:requests_total[10m])) > 0.05'),
            "for": "10m", "labels": {"severity": "ticket"},
            "annotations": {
                "summary": "{{ $labels.namespace }}/{{ $labels.service }}: more than 5% of "
                           "{{ $labels.class }} requests shed",
                "description": "Requests shed (429 at the proxies or the router, 503 at the router) per "
                               "request answered: {{ $value | humanizePercentage }} over 10m.",
                "runbook_url": runbook("requests-shed"),
            },
        },
    ]


def rule_groups() -> dict[str, Any]:
    """The rule file: `groups:` as Prometheus and `promtool` read it (a PrometheusRule's spec)."""
    return {"groups": [
        {"name": "decodeservice-slo.rules", "interval": "30s", "rules": _recording_rules()},
        {"name": "decodeservice.alerts", "rules": _alerts()},
    ]}
