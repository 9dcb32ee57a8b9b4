"""A small client of Prometheus's HTTP API (`/api/v1/query_range`), enough to draw the panels."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import httpx


class PrometheusError(Exception):
    """Prometheus could not be reached, or refused or failed a query."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Series:
    labels: dict[str, str]
    times: tuple[float, ...]  # unix seconds
    values: tuple[float, ...]  # NaN where Prometheus answered NaN (0/0 ratios)

    def has_numbers(self) -> bool:
        return any(math.isfinite(v) for v in self.values)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TimeRange:
    start: float
    end: float
    step: float

    def __post_init__(self) -> None:
        if not (self.end > self.start and self.step > 0):
            raise ValueError(f"bad time range {self.start}..{self.end} step {self.step}")


def _value(text: str) -> float:
    return float(text)  # Prometheus sends "NaN", "+Inf", "-Inf" as strings, which float() reads


def parse_matrix(body: dict[str, Any]) -> list[Series]:
    if body.get("status") != "success":
        raise PrometheusError(f"{body.get('errorType', 'error')}: {body.get('error', body)}")
    data = body.get("data") or {}
    if data.get("resultType") != "matrix":
        raise PrometheusError(f"expected a matrix, got {data.get('resultType')!r}")
    return [Series(labels={k: v for k, v in r["metric"].items() if k != "__name__"},
                   times=tuple(float(t) for t, _ in r["values"]),
                   values=tuple(_value(v) for _, v in r["values"])) for r in data.get("result") or []]


class PrometheusClient:
    def __init__(self, base_url: str, *, timeout: float = 10.0) -> None:
        self._client = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout)

    def __enter__(self) -> PrometheusClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self._client.close()

    def query_range(self, expr: str, window: TimeRange) -> list[Series]:
        params = {"query": expr, "start": f"{window.start:.3f}", "end": f"{window.end:.3f}",
                  "step": f"{window.step:g}"}
        try:
            response = self._client.get("/api/v1/query_range", params=params)
        except httpx.HTTPError as exc:
            raise PrometheusError(f"cannot reach Prometheus at {self._client.base_url}: {exc}") from exc
        try:
            body = response.json()
        except ValueError:
            raise PrometheusError(f"Prometheus answered {response.status_code} without JSON") from None
        return parse_matrix(body)
