"""Latency and throughput metrics, defined as `vllm bench serve` defines them.

All functions here are pure: they take the per-request records the client made and return numbers.

Definitions (every time is measured on the client, with a monotonic clock):

- **TTFT** (time to first token): from sending the request to receiving the first streamed chunk that
  carries content (text or a chat delta). Role-only and usage-only chunks do not count.
- **ITL** (inter-token latency): the gaps between consecutive content chunks of one request. A server that
  streams several tokens in one chunk (speculative decoding does) shows one longer gap, not several short
  ones, exactly as in vLLM. Percentiles pool the gaps of every request.
- **TPOT** (time per output token): per request, `(e2e - TTFT) / (output_tokens - 1)`; requests with one
  output token have no TPOT. Percentiles are over requests.
- **E2E** (end-to-end latency): from sending the request to receiving the end of its stream.
- **Output tokens**: the `usage.completion_tokens` of the final chunk (we ask for it with
  `stream_options.include_usage`) when the server sends it, else the number of content chunks.
- **Request throughput**: completed requests / wall time of the load level (first send to last end).
- **Output throughput**: output tokens of completed requests / the same wall time.
- **Goodput**: the share of *all* requests (failures count as misses) that meet every given SLO, and the
  same count divided by the wall time (req/s). Per request: `ttft` compares its TTFT; `itl` its mean
  inter-chunk gap; `tpot` its TPOT; `e2e` its end-to-end latency. Each bound is inclusive.
- **Percentiles**: `decodeservice.common.stats.percentile`, linear interpolation between the closest
  ranks (numpy's default, as vLLM computes them).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from decodeservice.common.stats import percentile
from decodeservice.loadgen.errors import BenchConfigError

PERCENTILES = (50, 90, 99)
SLO_KEYS = ("ttft", "itl", "tpot", "e2e")


@dataclass(frozen=True, kw_only=True)
class RequestRecord:
    """What the client saw for one request; times in seconds on `time.perf_counter`'s clock."""

    start: float
    end: float
    # Arrival time of each chunk that carried content, in order.
    chunk_times: tuple[float, ...] = ()
    output_tokens: int = 0
    prompt_tokens: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times)

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def itls(self) -> list[float]:
        times = self.chunk_times
        return [b - a for a, b in zip(times, times[1:], strict=False)]

    @property
    def mean_itl(self) -> float | None:
        gaps = self.itls
        return sum(gaps) / len(gaps) if gaps else None

    @property
    def tpot(self) -> float | None:
        ttft = self.ttft
        if ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - ttft) / (self.output_tokens - 1)


@dataclass(frozen=True, kw_only=True)
class Slo:
    """Per-request service-level objectives in milliseconds; `None` means no bound on that clock."""

    ttft_ms: float | None = None
    itl_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def __post_init__(self) -> None:
        for key in SLO_KEYS:
            value = getattr(self, f"{key}_ms")
            if value is not None and not value > 0:
                raise BenchConfigError(f"SLO {key} must be a positive number of milliseconds, got {value}")

    @property
    def empty(self) -> bool:
        return all(getattr(self, f"{key}_ms") is None for key in SLO_KEYS)

    @classmethod
    def parse(cls, text: str) -> Slo:
        """Parse `ttft=500,itl=50,e2e=10000` (milliseconds; any subset of ttft, itl, tpot, e2e)."""
        values: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, raw = part.partition("=")
            key = key.strip().lower()
            if not sep or key not in SLO_KEYS:
                raise BenchConfigError(f"bad SLO term {part!r}; use KEY=MS with KEY in {', '.join(SLO_KEYS)}")
            if key in values:
                raise BenchConfigError(f"SLO {key} given twice")
            try:
                values[key] = float(raw)
            except ValueError:
                raise BenchConfigError(f"SLO {key}={raw!r} is not a number of milliseconds") from None
        if not values:
            raise BenchConfigError("empty SLO; use e.g. ttft=500,itl=50,e2e=10000")
        return cls(**{f"{k}_ms": v for k, v in values.items()})

    def describe(self) -> str:
        terms = [f"{k}<={getattr(self, f'{k}_ms'):g}ms" for k in SLO_KEYS if getattr(self, f"{k}_ms") is not None]
        return ", ".join(terms) or "none"

    def met_by(self, record: RequestRecord) -> bool:
        """Whether one request meets every bound; a failed request meets none."""
        if not record.ok:
            return False
        checks = (
            (self.ttft_ms, record.ttft),
            (self.itl_ms, record.mean_itl),
            (self.tpot_ms, record.tpot),
            (self.e2e_ms, record.e2e),
        )
        # A request with one chunk has no ITL/TPOT: nothing to violate on those clocks.
        return all(bound is None or value is None or value * 1000.0 <= bound for bound, value in checks)


@dataclass(frozen=True, kw_only=True)
class Distribution:
    """Summary of one clock in milliseconds; all NaN-free (`None` when there was no sample)."""

    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None
    count: int

    @classmethod
    def of_seconds(cls, values: Iterable[float]) -> Distribution:
        ms = [v * 1000.0 for v in values]
        if not ms:
            return cls(mean=None, p50=None, p90=None, p99=None, count=0)
        p50, p90, p99 = (percentile(ms, q) for q in PERCENTILES)
        return cls(mean=math.fsum(ms) / len(ms), p50=p50, p90=p90, p99=p99, count=len(ms))


@dataclass(frozen=True, kw_only=True)
class LevelSummary:
    """Everything reported for one load level."""

    label: str
    num_requests: int
    completed: int
    failed: int
    duration_s: float
    total_output_tokens: int
    request_throughput: float  # completed req/s
    output_throughput: float  # output tok/s
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2e: Distribution
    goodput_fraction: float | None  # None when no SLO was given
    goodput_rps: float | None
    slo: str
    errors: tuple[str, ...] = field(default=())


def wall_time(records: Sequence[RequestRecord]) -> float:
    """First send to last end across the level."""
    if not records:
        return 0.0
    return max(r.end for r in records) - min(r.start for r in records)


def goodput(records: Sequence[RequestRecord], slo: Slo) -> float:
    """Share of requests meeting every SLO bound; failures count as misses."""
    if not records:
        return 0.0
    return sum(slo.met_by(r) for r in records) / len(records)


def summarize(records: Sequence[RequestRecord], *, label: str, slo: Slo | None = None) -> LevelSummary:
    ok = [r for r in records if r.ok]
    duration = wall_time(records)
    tokens = sum(r.output_tokens for r in ok)
    gp = goodput(records, slo) if slo is not None and not slo.empty else None

    def rate(count: float) -> float:
        return count / duration if duration > 0 else 0.0

    # Keep a few distinct error messages: enough to diagnose, bounded in the report.
    errors = tuple(dict.fromkeys(r.error for r in records if r.error))[:5]
    return LevelSummary(
        label=label,
        num_requests=len(records),
        completed=len(ok),
        failed=len(records) - len(ok),
        duration_s=duration,
        total_output_tokens=tokens,
        request_throughput=rate(len(ok)),
        output_throughput=rate(tokens),
        ttft=Distribution.of_seconds(t for r in ok if (t := r.ttft) is not None),
        tpot=Distribution.of_seconds(t for r in ok if (t := r.tpot) is not None),
        itl=Distribution.of_seconds(gap for r in ok for gap in r.itls),
        e2e=Distribution.of_seconds(r.e2e for r in ok),
        goodput_fraction=gp,
        goodput_rps=None if gp is None else rate(gp * len(records)),
        slo=slo.describe() if slo is not None else "none",
        errors=tuple(errors),
    )
