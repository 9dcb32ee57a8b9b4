"""Every router query of the dashboard names series the router really exports, with the labels it groups
by: checked against router/metrics.py's own registry (the real Prometheus run: test_prometheus_e2e.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from decodeservice.monitoring.panels import PANELS, Query, Source
from decodeservice.proxy.policy import PriorityClass
from decodeservice.router.metrics import SHED_REASONS, RouterMetrics

ROOT = Path(__file__).resolve().parents[2]
_NAME = re.compile(r"decode_router:[a-zA-Z0-9_:]+")
_BY = re.compile(r"by \(([^)]*)\)")
SCRAPE_LABELS = {"namespace", "service", "pod", "le"}  # from the PodMonitor (and `le` from the histogram)
ROUTER = [(p.title, i, q) for p in PANELS for i, q in enumerate(p.queries) if q.source is Source.ROUTER]


def exported() -> dict[str, set[str]]:
    """Sample name -> label names, from a router's /metrics once each labelled child has a value."""
    metrics = RouterMetrics()
    for p in PriorityClass:  # what a served, held, shed and predicted request leaves behind
        metrics.requests.labels(p.value, "200").inc()
        metrics.shed.labels(p.value, SHED_REASONS[0]).inc()
        metrics.predicted_ttft.labels(p.value).observe(0.1)
        metrics.ttft.labels(p.value).observe(0.2)
    metrics.decisions.labels("http://10.0.0.1:8000", "rendezvous").inc()
    names: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(metrics.render(ready=1, known=1).decode()):
        for sample in family.samples:
            names.setdefault(sample.name, set()).update(sample.labels)
    return names


def test_the_dashboard_has_router_panels_for_what_an_sre_asks() -> None:
    names = {m for _, _, q in ROUTER for m in _NAME.findall(q.expr)}
    assert {"decode_router:requests_total", "decode_router:requests_shed_total", "decode_router:requests_held",
            "decode_router:prefix_tokens_cached_total", "decode_router:prompt_tokens_total",
            "decode_router:predicted_ttft_seconds_bucket", "decode_router:time_to_first_token_seconds_bucket",
            } <= names


@pytest.mark.parametrize("query", [pytest.param(q, id=f"{title}-{i}") for title, i, q in ROUTER])
def test_each_router_query_names_exported_series_and_labels(query: Query) -> None:
    series = exported()
    names = _NAME.findall(query.expr)
    assert names, query.expr
    grouped = {label.strip() for group in _BY.findall(query.expr) for label in group.split(",")} - SCRAPE_LABELS
    for name in names:
        assert name in series, f"{name} is not exported by router/metrics.py (it has {sorted(series)})"
        assert grouped <= series[name], f"{name} lacks {grouped - series[name]}"
    shown = query.labels - SCRAPE_LABELS
    assert all(shown <= series[name] for name in names), query.legend


def test_router_metrics_doc_lists_every_name_the_dashboard_uses() -> None:
    doc = (ROOT / "router" / "METRICS.md").read_text()
    for _, _, query in ROUTER:
        for name in _NAME.findall(query.expr):
            base = re.sub(r"_(bucket|sum|count)$", "", name)
            assert f"`{base}`" in doc, f"router/METRICS.md does not document {base}"


def test_the_check_can_fail() -> None:
    # Guards the guard: a misspelt name, or a label the router does not put on the series, is caught.
    series = exported()
    assert "decode_router:request_total" not in series
    assert "reason" not in series["decode_router:requests_total"]
