"""Poisson arrivals are seeded and reproducible, and the client really sends on that schedule."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import pytest

from decodeservice.loadgen.client import BenchRequest
from decodeservice.loadgen.errors import BenchConfigError
from decodeservice.loadgen.load import LoadLevel, parse_concurrency, poisson_schedule, run_level


def test_poisson_schedule_is_seeded_and_reproducible() -> None:
    a = poisson_schedule(200, rate=5.0, seed=42)
    assert a == poisson_schedule(200, rate=5.0, seed=42)
    assert a != poisson_schedule(200, rate=5.0, seed=43)
    assert all(later > earlier for earlier, later in zip(a, a[1:], strict=False))


def test_poisson_gaps_have_the_right_mean_and_spread() -> None:
    offsets = poisson_schedule(20000, rate=4.0, seed=1)
    gaps = [b - a for a, b in zip([0.0, *offsets[:-1]], offsets, strict=True)]
    # Exponential gaps: mean = std = 1/rate.
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.03)
    assert statistics.pstdev(gaps) == pytest.approx(0.25, rel=0.05)


async def test_rate_level_sends_on_the_schedule(fake_server: Callable[..., str]) -> None:
    url = fake_server("--ttft", "0.01", "--itl", "0.005")
    requests = [BenchRequest(id=str(i), prompt="hi", max_tokens=2) for i in range(12)]
    records = await run_level(url=url, model="fake-model", requests=requests,
                              level=LoadLevel(kind="rate", value=20.0), seed=9)
    schedule = poisson_schedule(12, rate=20.0, seed=9)
    starts = [r.start - records[0].start for r in records]
    expected = [s - schedule[0] for s in schedule]
    assert all(r.ok for r in records)
    assert starts == pytest.approx(expected, abs=0.03)


async def test_concurrency_level_keeps_c_in_flight(fake_server: Callable[..., str]) -> None:
    url = fake_server("--ttft", "0.3", "--itl", "0.01")
    requests = [BenchRequest(id=str(i), prompt="hi", max_tokens=2) for i in range(8)]
    records = await run_level(url=url, model="fake-model", requests=requests,
                              level=LoadLevel(kind="concurrency", value=4))
    # Sweep the start/end events: the most requests ever in flight at once is exactly the concurrency.
    events = sorted([(r.start, 1) for r in records] + [(r.end, -1) for r in records], key=lambda e: (e[0], e[1]))
    in_flight, peak = 0, 0
    for _, step in events:
        in_flight += step
        peak = max(peak, in_flight)
    assert all(r.ok for r in records) and peak == 4


@pytest.mark.parametrize("text", ["0", "1,x", "-2", "1,,4"])
def test_bad_concurrency(text: str) -> None:
    with pytest.raises(BenchConfigError):
        parse_concurrency(text)


def test_bad_rate() -> None:
    with pytest.raises(BenchConfigError):
        LoadLevel(kind="rate", value=0)
