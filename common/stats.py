"""The one percentile rule of the project: the proxy's SLOs, `decodectl bench` and the benchmarks.

`percentile(values, p)` sorts the values x[0] <= ... <= x[n-1], takes the position h = (n - 1) * p / 100
and interpolates linearly between its neighbours: x[floor(h)] + (h - floor(h)) * (x[floor(h) + 1] -
x[floor(h)]). This is numpy's default ("linear", Hyndman & Fan type 7) and what `vllm bench serve`
reports, so `decodectl bench` numbers compare with vLLM's; p50 is the median (`statistics.median`),
p0 the minimum and p100 the maximum. Pure Python: the proxy calls it on its request path.
"""

from __future__ import annotations

import math
from collections.abc import Iterable


def percentile(values: Iterable[float], p: float) -> float:
    """The p-th percentile (p in [0, 100]) of `values`, which need not be sorted and must not be empty."""
    if not 0.0 <= p <= 100.0:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile of no values")
    h = (len(ordered) - 1) * p / 100.0
    low = math.floor(h)
    if low + 1 >= len(ordered):
        return float(ordered[-1])
    return float(ordered[low] + (h - low) * (ordered[low + 1] - ordered[low]))
