"""Metric definitions and goodput against hand-computed cases."""

from __future__ import annotations

import math

import pytest

from decodeservice.loadgen.errors import BenchConfigError
from decodeservice.loadgen.metrics import RequestRecord, Slo, goodput, summarize


def record(ttft: float, gaps: list[float], *, tail: float = 0.0, tokens: int | None = None,
           error: str | None = None) -> RequestRecord:
    times = [ttft]
    for gap in gaps:
        times.append(times[-1] + gap)
    return RequestRecord(start=0.0, end=times[-1] + tail, chunk_times=tuple(times),
                         output_tokens=tokens if tokens is not None else len(times), error=error)


def test_per_request_clocks() -> None:
    r = record(0.5, [0.1, 0.3], tail=0.1, tokens=5)  # 3 chunks carrying 5 tokens (speculation)
    assert r.ttft == pytest.approx(0.5)
    assert r.itls == pytest.approx([0.1, 0.3])
    assert r.mean_itl == pytest.approx(0.2)
    assert r.e2e == pytest.approx(1.0)
    assert r.tpot == pytest.approx((1.0 - 0.5) / 4)  # (e2e - ttft) / (tokens - 1)
    assert record(0.2, [], tokens=1).tpot is None


def test_goodput_hand_computed() -> None:
    slo = Slo(ttft_ms=300, itl_ms=50, e2e_ms=1000)
    records = [
        record(0.2, [0.04, 0.05]),          # meets all (itl mean 45 ms, e2e 290 ms)
        record(0.4, [0.01]),                # ttft 400 > 300: miss
        record(0.1, [0.02, 0.10]),          # mean itl 60 > 50: miss (a single 100 ms gap alone is not the test)
        record(0.3, [0.05] * 3),            # exactly at the ttft and itl bounds: inclusive, meets
        record(0.1, [0.04] * 30),           # e2e 1.3 s > 1 s: miss
        record(0.1, [0.01], error="HTTP 500: boom"),  # failures never meet an SLO
    ]
    assert [slo.met_by(r) for r in records] == [True, False, False, True, False, False]
    assert goodput(records, slo) == pytest.approx(2 / 6)
    summary = summarize(records, label="x", slo=slo)
    assert summary.goodput_fraction == pytest.approx(2 / 6)
    assert summary.goodput_rps == pytest.approx(2 / summary.duration_s)
    assert summary.completed == 5 and summary.failed == 1
    assert summary.errors == ("HTTP 500: boom",)


def test_goodput_single_bound_and_no_slo() -> None:
    records = [record(0.1 * i, [0.01]) for i in range(1, 11)]  # ttft 100 ... 1000 ms
    assert goodput(records, Slo(ttft_ms=450)) == pytest.approx(0.4)
    assert goodput(records, Slo(tpot_ms=5)) == 0.0
    assert summarize(records, label="x").goodput_fraction is None


def test_percentiles_and_throughput() -> None:
    # Ten requests, request i: ttft i*10 ms, then 9 gaps of 20 ms; sequential, 10 tokens each.
    records = []
    clock = 0.0
    for i in range(1, 11):
        ttft = i * 0.01
        times = [clock + ttft + k * 0.02 for k in range(10)]
        records.append(RequestRecord(start=clock, end=times[-1], chunk_times=tuple(times), output_tokens=10))
        clock = times[-1]
    s = summarize(records, label="c=1")
    assert s.ttft.p50 == pytest.approx(55.0)
    assert s.ttft.p90 == pytest.approx(91.0)
    assert s.ttft.p99 == pytest.approx(99.1)
    assert s.itl.p50 == pytest.approx(20.0) and s.itl.count == 90
    assert s.tpot.p99 == pytest.approx(20.0)
    assert s.output_throughput == pytest.approx(100 / clock)
    assert s.request_throughput == pytest.approx(10 / clock)
    assert not math.isnan(s.e2e.mean or math.nan)


@pytest.mark.parametrize("text", ["ttft", "ttft=abc", "foo=10", "ttft=10,ttft=20", "", "itl=-5", "e2e=0"])
def test_bad_slo(text: str) -> None:
    with pytest.raises(BenchConfigError):
        Slo.parse(text)


def test_slo_parse() -> None:
    assert Slo.parse("ttft=500, itl=50,e2e=10000") == Slo(ttft_ms=500, itl_ms=50, e2e_ms=10000)
