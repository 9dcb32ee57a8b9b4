"""Read every ready pod's proxy `/metrics` and turn each body into a `PodSample`.

Pods come from the API (listed by the DecodeService's selector labels); each ready one is fetched in
parallel with a short timeout and a cap on the body size. A body is parsed with prometheus_client's text
parser and checked the way a hostile body demands: histogram buckets ascending to +Inf with
non-decreasing finite counts, gauges finite and non-negative, KV usage within [0, 1], a bounded number
of classes. Anything else (a timeout, a refused connection, an HTTP error, a body over the cap, binary
or NaN) makes that pod a failed pod: it is left out and counted, never raised out of the tick, so one
broken pod can neither block a decision nor push it to max.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from decodeservice.operator.autoscaler.types import ClassMetrics, Histogram, PodSample
from decodeservice.operator.engines import PROXY_PORT

# The proxy's own families (proxy/METRICS.md) and the engine's, relayed by the proxy under their vllm: names.
TTFT = "decode_proxy:time_to_first_token_seconds"
ITL = "decode_proxy:inter_token_latency_seconds"
QUEUE = "decode_proxy:num_requests_waiting"
INFLIGHT = "decode_proxy:num_requests_running"
# vLLM's names in the supported releases (tests/support/contracts/vllm/); the builtin engine exposes the same.
# (`vllm:gpu_cache_usage_perc`, its name before 0.10, is gone from them, so it is not read.)
KV_USAGE = "vllm:kv_cache_usage_perc"
ENGINE_WAITING = "vllm:num_requests_waiting"
ENGINE_RUNNING = "vllm:num_requests_running"
SHED = "decode_proxy:requests_shed_total"
CAPACITY_SHED_REASONS = frozenset({"slo", "queue_full"})  # a tenant's rate limit is policy, not demand

_USED = frozenset({f"{TTFT}_bucket", f"{ITL}_bucket", f"{TTFT}_count", f"{ITL}_count", QUEUE, INFLIGHT, KV_USAGE,
                   ENGINE_WAITING, ENGINE_RUNNING, SHED})
MAX_CLASSES = 16  # the proxy has two; more is a body we did not write
MAX_BUCKETS = 64


class ScrapeError(ValueError):
    """A body that is not a DecodeService proxy's metrics, or is inconsistent; the message says why."""


@dataclass(frozen=True, kw_only=True)
class ScrapeSettings:
    timeout_seconds: float = 2.0  # well under the 5 s tick: a slow pod must not delay the decision
    max_body_bytes: int = 1 << 20  # the proxy's body is ~20 KiB; relayed vllm: series included

    def __post_init__(self) -> None:
        if self.timeout_seconds <= 0 or self.max_body_bytes <= 0:
            raise ValueError("timeout_seconds and max_body_bytes must be > 0")


@dataclass(frozen=True, kw_only=True)
class PodTarget:
    pod: str
    url: str  # the proxy's base URL, e.g. http://10.0.0.7:8000


@dataclass(frozen=True, kw_only=True)
class PodCensus:
    """The pods of one DecodeService as the API lists them."""

    ready: tuple[PodTarget, ...]
    starting: int  # exist, not ready, not terminating: capacity on its way


@dataclass(frozen=True, kw_only=True)
class ScrapeResult:
    samples: tuple[PodSample, ...]
    failed: tuple[str, ...]
    errors: Mapping[str, str]  # pod -> why it failed (for the log)


def _is_ready(pod: Mapping[str, Any]) -> bool:
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if isinstance(cond, Mapping) and cond.get("type") == "Ready":
            return cond.get("status") == "True"
    return False


def census(pods: Iterable[Mapping[str, Any]], *, overrides: Mapping[str, str] | None = None) -> PodCensus:
    """Ready pods with an IP become targets; pods still starting are counted.

    `overrides` maps a pod name to a base URL. It exists for tests, whose stand-in pods are loopback
    servers on ports of their own; in a cluster every pod is reached at its IP on the proxy port."""
    ready: list[PodTarget] = []
    starting = 0
    for pod in pods:
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        if meta.get("deletionTimestamp") or status.get("phase") in ("Succeeded", "Failed"):
            continue  # terminating or finished: neither capacity nor a source of metrics
        name = str(meta.get("name") or "")
        ip = status.get("podIP")
        if _is_ready(pod) and ip and name:
            host = f"[{ip}]" if ":" in str(ip) else str(ip)
            url = (overrides or {}).get(name) or f"http://{host}:{PROXY_PORT}"
            ready.append(PodTarget(pod=name, url=url.rstrip("/")))
        else:
            starting += 1
    return PodCensus(ready=tuple(sorted(ready, key=lambda t: t.pod)), starting=starting)


def _finite(value: float, what: str) -> float:
    if not math.isfinite(value) or value < 0:
        raise ScrapeError(f"{what} is {value!r}, not a finite non-negative number")
    return float(value)


def _le(raw: str | None, family: str) -> float:
    try:
        bound = float(raw) if raw is not None else math.nan
    except ValueError:
        raise ScrapeError(f"{family}: bucket bound {raw!r} is not a number") from None
    if math.isnan(bound):
        raise ScrapeError(f"{family}: a bucket has no le bound")
    return bound


def _histogram(family: str, buckets: dict[float, float], total: float | None) -> Histogram:
    if len(buckets) > MAX_BUCKETS:
        raise ScrapeError(f"{family}: {len(buckets)} buckets (at most {MAX_BUCKETS})")
    bounds = tuple(sorted(buckets))
    if not bounds or bounds[-1] != math.inf:
        raise ScrapeError(f"{family}: no +Inf bucket")
    counts = tuple(buckets[b] for b in bounds)
    if any(b > a for a, b in zip(counts[1:], counts, strict=False)):
        raise ScrapeError(f"{family}: cumulative bucket counts decrease")
    return Histogram(bounds=bounds, counts=counts, total=counts[-1] if total is None else total)


def parse_metrics(text: str, *, pod: str, at: float) -> PodSample:
    """One proxy `/metrics` body -> `PodSample`; raises ScrapeError for anything not trustworthy."""
    buckets: dict[tuple[str, str], dict[float, float]] = {}  # (family, class) -> le -> count
    totals: dict[tuple[str, str], float] = {}
    queue: dict[str, float] = {}
    shed: dict[str, float] = {}
    inflight: float | None = None
    engine: dict[str, float] = {}
    try:
        families = list(text_string_to_metric_families(text))
    except Exception as exc:  # the parser raises ValueError, IndexError, TypeError, ... on garbage
        raise ScrapeError(f"unparseable metrics body: {type(exc).__name__}: {str(exc)[:200]}") from None
    for family in families:
        for s in family.samples:
            name, labels = s.name, s.labels
            if name not in _USED:
                continue  # only what the decision reads is checked: other series may be anything
            value = _finite(float(s.value), name)
            cls = labels.get("class", "")
            if name in (f"{TTFT}_bucket", f"{ITL}_bucket"):
                base = name.removesuffix("_bucket")
                buckets.setdefault((base, cls), {})[_le(labels.get("le"), base)] = value
            elif name in (f"{TTFT}_count", f"{ITL}_count"):
                totals[(name.removesuffix("_count"), cls)] = value
            elif name == QUEUE and cls:
                queue[cls] = queue.get(cls, 0.0) + value
            elif name == SHED and cls and labels.get("reason") in CAPACITY_SHED_REASONS:
                shed[cls] = shed.get(cls, 0.0) + value
            elif name == INFLIGHT:
                inflight = (inflight or 0.0) + value
            elif name == KV_USAGE:
                engine[KV_USAGE] = max(engine.get(KV_USAGE, 0.0), value)  # the fullest cache, if several series
            elif name in (ENGINE_WAITING, ENGINE_RUNNING):
                engine[name] = engine.get(name, 0.0) + value  # one series per model_name / engine: their sum
    if inflight is None:
        raise ScrapeError(f"no {INFLIGHT} series: not a DecodeService proxy's /metrics")
    if engine.get(KV_USAGE, 0.0) > 1.0:
        raise ScrapeError(f"{KV_USAGE} is {engine[KV_USAGE]!r}, outside [0, 1]")
    names = {cls for _, cls in buckets} | set(queue) | set(shed)
    names.discard("")
    if len(names) > MAX_CLASSES:
        raise ScrapeError(f"{len(names)} classes (at most {MAX_CLASSES})")
    classes = {}
    for cls in sorted(names):
        hist = {f: _histogram(f, buckets[(f, cls)], totals.get((f, cls)))
                for f in (TTFT, ITL) if (f, cls) in buckets}
        classes[cls] = ClassMetrics(ttft=hist.get(TTFT), itl=hist.get(ITL), queue_depth=queue.get(cls, 0.0),
                                    shed=shed.get(cls, 0.0))
    return PodSample(pod=pod, at=at, classes=classes, inflight=inflight, kv_cache_usage=engine.get(KV_USAGE),
                     engine_waiting=engine.get(ENGINE_WAITING), engine_running=engine.get(ENGINE_RUNNING))


async def _fetch(session: aiohttp.ClientSession, target: PodTarget, settings: ScrapeSettings) -> str:
    async with session.get(f"{target.url}/metrics") as resp:
        if resp.status != 200:
            raise ScrapeError(f"HTTP {resp.status}")
        body = bytearray()
        async for chunk in resp.content.iter_chunked(64 * 1024):
            body += chunk
            if len(body) > settings.max_body_bytes:
                raise ScrapeError(f"body over {settings.max_body_bytes} bytes")
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        raise ScrapeError("body is not UTF-8 text") from None


async def _scrape_one(session: aiohttp.ClientSession, target: PodTarget, settings: ScrapeSettings,
                      clock: Callable[[], float]) -> PodSample | str:
    at = clock()
    try:
        text = await asyncio.wait_for(_fetch(session, target, settings), timeout=settings.timeout_seconds)
        return parse_metrics(text, pod=target.pod, at=at)
    except ScrapeError as exc:
        return str(exc)
    except TimeoutError:
        return f"no answer within {settings.timeout_seconds:g}s"
    except (aiohttp.ClientError, OSError) as exc:
        return f"{type(exc).__name__}: {exc}"


async def scrape(session: aiohttp.ClientSession, targets: Sequence[PodTarget], *, settings: ScrapeSettings,
                 clock: Callable[[], float]) -> ScrapeResult:
    """Scrape every target at once; each pod either yields a sample or is listed as failed with why."""
    results = await asyncio.gather(*(_scrape_one(session, t, settings, clock) for t in targets))
    samples = tuple(r for r in results if isinstance(r, PodSample))
    errors = {t.pod: r for t, r in zip(targets, results, strict=True) if isinstance(r, str)}
    return ScrapeResult(samples=samples, failed=tuple(errors), errors=errors)
