"""The proxy's /metrics: parses as Prometheus text, carries every documented name, measures streams."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tests.support.fake_engine import FakeEngine

METRICS_MD = Path(__file__).resolve().parents[2] / "proxy" / "METRICS.md"


def _documented() -> set[str]:
    return set(re.findall(r"^\| `(decode_proxy:[a-z0-9_]+)`", METRICS_MD.read_text(), flags=re.M))


def _family_name(name: str) -> str:
    return name.removesuffix("_total")  # the parser names counter families without the suffix


async def test_metrics_parse_and_match_the_documentation(engine: FakeEngine, proxy: Any) -> None:
    engine.ttft_s, engine.itl_s = 0.05, 0.01
    policy = {"outputLength": {"maxOutputTokens": 6, "defaultMaxTokens": 4}, "slo": {"ttftMs": 5000, "itlMs": 1000}}
    async with proxy(policy, engine.url) as (_, client):
        for priority in ("interactive", "batch"):
            body = {"model": "m", "prompt": "x", "max_tokens": 50, "stream": True,
                    "stream_options": {"include_usage": True}}
            r = await client.post("/v1/completions", json=body, headers={"x-priority": priority})
            assert r.status_code == 200
        await client.post("/v1/completions", content=b"{")
        response = await client.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    documented = _documented()
    assert len(documented) == 18
    exported = {n for n in families if n.startswith("decode_proxy:") and not n.endswith("_created")}
    assert {_family_name(n) for n in documented} == exported

    def value(family: str, sample: str, **labels: str) -> float:
        return next(s.value for s in families[family].samples
                    if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()))

    ttft = "decode_proxy:time_to_first_token_seconds"
    assert value(ttft, ttft + "_count", **{"class": "batch"}) == 1
    assert value(ttft, ttft + "_sum", **{"class": "batch"}) >= 0.05
    itl = "decode_proxy:inter_token_latency_seconds"
    assert value(itl, itl + "_count", **{"class": "interactive"}) == 5  # 6 tokens after clamping
    tokens = "decode_proxy:generation_tokens"
    assert value(tokens, tokens + "_total", **{"class": "interactive"}) == 6
    clamped = "decode_proxy:requests_clamped"
    assert value(clamped, clamped + "_total", **{"class": "batch"}) == 1
    att = "decode_proxy:slo_attainment_ratio"
    assert value(att, att, **{"class": "interactive", "objective": "all"}) == 1.0
    assert value("decode_proxy:slo_target_ratio", "decode_proxy:slo_target_ratio") == 0.95
    assert value("decode_proxy:requests_rejected", "decode_proxy:requests_rejected_total",
                 reason="malformed_json") == 1
    assert value("decode_proxy:num_requests_running", "decode_proxy:num_requests_running") == 0


async def test_attainment_drops_when_the_slo_is_missed(engine: FakeEngine, proxy: Any) -> None:
    engine.ttft_s = 0.1
    async with proxy({"slo": {"ttftMs": 50}}, engine.url) as (_, client):
        body = {"model": "m", "prompt": "x", "max_tokens": 2, "stream": True}
        assert (await client.post("/v1/completions", json=body)).status_code == 200
        text = (await client.get("/metrics")).text
    assert 'decode_proxy:slo_attainment_ratio{class="interactive",objective="ttft"} 0.0' in text
    assert 'decode_proxy:slo_attainment_ratio{class="interactive",objective="itl"} 1.0' in text
    assert 'decode_proxy:slo_requests_total{class="interactive",objective="ttft",outcome="missed"} 1.0' in text
    assert 'decode_proxy:slo_requests_total{class="interactive",objective="ttft",outcome="met"} 0.0' in text
    assert 'decode_proxy:slo_requests_total{class="interactive",objective="itl",outcome="met"} 1.0' in text
