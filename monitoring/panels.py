"""The dashboard's panels as data: titles, units and PromQL, read by both views.

scripts/generate_dashboards.py turns them into the Grafana dashboard the chart ships, and
`decodectl dashboard` (monitoring/png.py) runs the same queries against a Prometheus and draws them,
so a laptop run and a cluster show one view.

Queries carry Grafana's template variables: `$namespace`, `$service` and `$class` (regexes, so "all"
is `.+`) and `$__rate_interval`. `expand` substitutes them for a direct query. The labels a panel shows
are the `{{label}}` placeholders of its legends; the PodMonitor's relabelling gives the DecodeService
pods' and the routers' series `namespace` and `service`, and the operator's series carry `namespace` and
`name` themselves (docs/monitoring.md).
"""

from __future__ import annotations

import dataclasses
import enum
import re


class Source(enum.StrEnum):
    """Which process exports a query's series (a test starts what each needs)."""

    PROXY = "proxy"
    ENGINE = "engine"  # vllm:* series, relayed by the proxy's /metrics
    ROUTER = "router"
    OPERATOR = "operator"


class Unit(enum.StrEnum):
    """Grafana unit ids (the PNG labels its axes from them too)."""

    RATIO = "percentunit"
    SECONDS = "s"
    PER_SECOND = "reqps"
    TOKENS_PER_SECOND = "short"
    COUNT = "short"


_PLACEHOLDER = re.compile(r"\{\{\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\}\}")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Query:
    expr: str
    legend: str  # Grafana legend format: {{label}} placeholders
    source: Source

    @property
    def labels(self) -> frozenset[str]:
        """The labels the legend shows: every series the query returns must carry them."""
        return frozenset(_PLACEHOLDER.findall(self.legend))


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Panel:
    title: str
    description: str
    unit: Unit
    queries: tuple[Query, ...]
    main: bool = False  # drawn by `decodectl dashboard` too

    def __post_init__(self) -> None:
        if not self.queries:
            raise ValueError(f"panel {self.title!r} has no query")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Row:
    title: str
    panels: tuple[Panel, ...]


def expand(expr: str, *, namespace: str = ".+", service: str = ".+", klass: str = ".+",
           rate_interval: str = "1m") -> str:
    """The query with the dashboard's variables replaced, for Prometheus's own API."""
    return (expr.replace("$__rate_interval", rate_interval).replace("$namespace", namespace)
            .replace("$service", service).replace("$class", klass))


# Series selectors. The pods' and routers' series are keyed by `service` (the DecodeService's name),
# the operator's by `name`, as kube-state-metrics names its objects.
_POD = 'namespace=~"$namespace", service=~"$service"'
_CLS = f'{_POD}, class=~"$class"'
_OP = 'namespace=~"$namespace", name=~"$service"'
_BY_SVC = "namespace, service"
_BY_CLS = "namespace, service, class"


def _rate(metric: str, selector: str, by: str) -> str:
    return f"sum by ({by}) (rate({metric}{{{selector}}}[$__rate_interval]))"


def _quantiles(metric: str, *, source: Source = Source.PROXY, what: str = "",
               percentiles: tuple[int, ...] = (50, 95, 99)) -> tuple[Query, ...]:
    buckets = f"sum by ({_BY_CLS}, le) (rate({metric}_bucket{{{_CLS}}}[$__rate_interval]))"
    prefix = "router " if source is Source.ROUTER else ""
    return tuple(Query(expr=f"histogram_quantile({p / 100:g}, {buckets})",
                       legend=f"{prefix}{{{{service}}}} {{{{class}}}} {what}p{p}", source=source)
                 for p in percentiles)


def _share(num: str, den: str, selector: str, by: str, legend: str, source: Source, *,
           num_filter: str = "") -> Query:
    num_selector = f"{selector}, {num_filter}" if num_filter else selector
    return Query(expr=f"{_rate(num, num_selector, by)} / {_rate(den, selector, by)}", legend=legend,
                 source=source)


SLO = Row(title="Service level", panels=(
    Panel(title="SLO attainment", main=True, unit=Unit.RATIO,
          description="Share of finished requests meeting each objective (TTFT <= slo.ttftMs, the request's "
                      "percentile ITL <= slo.itlMs), from the proxies' met/missed counters, against the "
                      "target (slo.percentile).",
          queries=(
              _share("decode_proxy:slo_requests_total", "decode_proxy:slo_requests_total", _CLS,
                     f"{_BY_CLS}, objective", "{{service}} {{class}} {{objective}}", Source.PROXY,
                     num_filter='outcome="met"'),
              Query(expr=f"max by ({_BY_SVC}) (decode_proxy:slo_target_ratio{{{_POD}}})",
                    legend="{{service}} target", source=Source.PROXY),
          )),
    Panel(title="Time to first token", main=True, unit=Unit.SECONDS,
          description="TTFT measured at the proxies (queueing and batching windows included), p50/p95/p99.",
          queries=_quantiles("decode_proxy:time_to_first_token_seconds")),
    Panel(title="Inter-token latency", main=True, unit=Unit.SECONDS,
          description="Gaps between streamed tokens measured at the proxies, p50/p95/p99.",
          queries=_quantiles("decode_proxy:inter_token_latency_seconds")),
))

TRAFFIC = Row(title="Traffic", panels=(
    Panel(title="Requests by status", main=True, unit=Unit.PER_SECOND,
          description="Answers per second by HTTP status: at the proxies (429: shed), and at the router "
                      "(503: held past --hold-seconds or too many held) when routing is on.",
          queries=(
              Query(expr=_rate("decode_proxy:requests_total", _CLS, f"{_BY_CLS}, status"),
                    legend="{{service}} {{class}} {{status}}", source=Source.PROXY),
              Query(expr=_rate("decode_router:requests_total", _CLS, f"{_BY_CLS}, status"),
                    legend="router {{service}} {{class}} {{status}}", source=Source.ROUTER),
          )),
    Panel(title="Shed and held", main=True, unit=Unit.PER_SECOND,
          description="Requests shed per second by reason (proxy: slo, queue_full, tenant_rate; router: slo, "
                      "hold_timeout, hold_full) and the requests the router holds for a ready endpoint.",
          queries=(
              Query(expr=_rate("decode_proxy:requests_shed_total", _CLS, f"{_BY_CLS}, reason"),
                    legend="{{service}} {{class}} shed {{reason}}", source=Source.PROXY),
              Query(expr=_rate("decode_router:requests_shed_total", _CLS, f"{_BY_CLS}, reason"),
                    legend="router {{service}} {{class}} shed {{reason}}", source=Source.ROUTER),
              Query(expr=f"sum by ({_BY_CLS}) (decode_router:requests_held{{{_CLS}}})",
                    legend="router {{service}} {{class}} held", source=Source.ROUTER),
          )),
    Panel(title="Output tokens per second", main=True, unit=Unit.TOKENS_PER_SECOND,
          description="Tokens relayed to clients by the proxies.",
          queries=(Query(expr=_rate("decode_proxy:generation_tokens_total", _CLS, _BY_CLS),
                         legend="{{service}} {{class}}", source=Source.PROXY),)),
))

CAPACITY = Row(title="Capacity", panels=(
    Panel(title="Replicas", main=True, unit=Unit.COUNT,
          description="Desired (spec, or the builtin autoscaler's decision), current and ready replicas, "
                      "from each DecodeService's status (the operator's /metrics).",
          queries=(Query(expr=f"max by (namespace, name, state) (decodeservice_replicas{{{_OP}}})",
                         legend="{{name}} {{state}}", source=Source.OPERATOR),)),
    Panel(title="Autoscaler signal", unit=Unit.COUNT,
          description="The builtin autoscaler's signal (status.slo.signal): above 1 it scales up.",
          queries=(Query(expr=f"max by (namespace, name) (decodeservice_autoscaler_signal{{{_OP}}})",
                         legend="{{name}}", source=Source.OPERATOR),)),
    Panel(title="Queue depth", main=True, unit=Unit.COUNT,
          description="Requests waiting in the proxies' class queues and in the engines' schedulers.",
          queries=(
              Query(expr=f"sum by ({_BY_CLS}) (decode_proxy:num_requests_waiting{{{_CLS}}})",
                    legend="{{service}} {{class}} proxy", source=Source.PROXY),
              Query(expr=f"sum by ({_BY_SVC}) (vllm:num_requests_waiting{{{_POD}}})",
                    legend="{{service}} engine", source=Source.ENGINE),
          )),
    Panel(title="KV cache usage", main=True, unit=Unit.RATIO,
          description="Each engine's KV-cache usage (1 is full).",
          queries=(Query(expr=f"max by ({_BY_SVC}, pod) (vllm:kv_cache_usage_perc{{{_POD}}})",
                         legend="{{service}} {{pod}}", source=Source.ENGINE),)),
    Panel(title="Cold start of new replicas", unit=Unit.SECONDS,
          description="Pod creation to Ready for the latest new replicas (status.coldStart.lastSeconds).",
          queries=(Query(expr=f"max by (namespace, name) (decodeservice_cold_start_seconds{{{_OP}}})",
                         legend="{{name}}", source=Source.OPERATOR),)),
))

SPECULATION = Panel(title="Speculation acceptance", unit=Unit.RATIO,
                    description="Draft tokens accepted per draft token proposed (speculative decoding on).",
                    queries=(_share("vllm:spec_decode_num_accepted_tokens_total",
                                    "vllm:spec_decode_num_draft_tokens_total", _POD, _BY_SVC, "{{service}}",
                                    Source.ENGINE),))

EFFICIENCY = Row(title="Efficiency", panels=(
    Panel(title="Prefix cache hit share", main=True, unit=Unit.RATIO,
          description="Prompt tokens found in the engines' prefix caches, and at the router the tokens the "
                      "engines reported cached on the endpoints it chose.",
          queries=(
              _share("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", _POD, _BY_SVC,
                     "{{service}} engine", Source.ENGINE),
              _share("decode_router:prefix_tokens_cached_total", "decode_router:prompt_tokens_total", _POD,
                     _BY_SVC, "router {{service}}", Source.ROUTER),
          )),
    SPECULATION,
    Panel(title="Router TTFT: predicted and measured", unit=Unit.SECONDS,
          description="The TTFT the router predicted for the endpoint it chose, at dispatch, beside the TTFT "
                      "it measured (arrival at the router to the first token, holding included): apart, the "
                      "router's latency model is off and its routing and shedding with it.",
          queries=(*_quantiles("decode_router:predicted_ttft_seconds", source=Source.ROUTER, what="predicted ",
                               percentiles=(50, 95)),
                   *_quantiles("decode_router:time_to_first_token_seconds", source=Source.ROUTER,
                               what="measured ", percentiles=(50, 95)))),
))

ROWS: tuple[Row, ...] = (SLO, TRAFFIC, CAPACITY, EFFICIENCY)
PANELS: tuple[Panel, ...] = tuple(p for row in ROWS for p in row.panels)
MAIN_PANELS: tuple[Panel, ...] = tuple(p for p in PANELS if p.main)
