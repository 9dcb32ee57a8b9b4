"""The real-vLLM lane: our proxy in front of a real vLLM (CPU build), as the operator renders the pod.

Run by scripts/vllm_lane.sh, which starts the pod (scripts/vllm_lane/pod.py) and points VLLM_LANE_STATE
at what it saw while starting; without it every test here is skipped, with that reason. The tests run in
file order and the last one stops the engine, so run the file whole.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from decodeservice.operator.autoscaler.scrape import parse_metrics
from tests.support.vllm_standin import LATEST, Contract

STATE = os.environ.get("VLLM_LANE_STATE")
pytestmark = pytest.mark.skipif(STATE is None, reason="no real vLLM: run scripts/vllm_lane.sh (it sets "
                                                       "VLLM_LANE_STATE)")
PROMPT = "Write one sentence about the sea."


@pytest.fixture(scope="module")
def state() -> dict[str, Any]:
    assert STATE is not None
    data: dict[str, Any] = json.loads(Path(STATE).read_text(encoding="utf-8"))
    return data


@pytest.fixture(scope="module")
def client(state: dict[str, Any]) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {state['api_key']}"}
    with httpx.Client(base_url=state["proxy_url"], headers=headers, timeout=120.0) as c:
        yield c


def _chat(**body: Any) -> dict[str, Any]:
    return {"model": "llama-3.1-8b", "messages": [{"role": "user", "content": PROMPT}], "temperature": 0, **body}


def _events(text: str) -> list[Any]:
    data = [line.removeprefix("data: ") for line in text.split("\n\n") if line.startswith("data: ")]
    assert data[-1] == "[DONE]", text
    return [json.loads(d) for d in data[:-1]]


def _metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def test_the_proxy_said_503_while_vllm_loaded_then_ready(state: dict[str, Any]) -> None:
    """vLLM does not listen while it loads; the proxy's /ready answered 503 meanwhile (never 200)."""
    startup = state["startup"]
    loading = [s for s in startup if not s["engine_listening"] and s["proxy_ready"] is not None]
    assert loading and {s["proxy_ready"] for s in loading} == {503}, startup
    assert startup[-1]["proxy_ready"] == 200 and startup[-1]["engine_listening"]
    assert "--kv-cache-memory-bytes" in state["engine_argv"]  # the CPU build, sized from the memory request


def test_a_stream_without_include_usage_has_no_usage_and_one_with_it_does(client: httpx.Client) -> None:
    plain = _events(client.post("/v1/chat/completions", json=_chat(max_tokens=4, stream=True)).text)
    bare = _events(client.post("/v1/chat/completions", json=_chat(max_tokens=4, stream=True,
                                                                  stream_options={})).text)
    asked = _events(client.post("/v1/chat/completions", json=_chat(
        max_tokens=4, stream=True, stream_options={"include_usage": True})).text)
    assert plain[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert not any("usage" in e for e in plain + bare)  # include_usage defaults to false
    assert asked[-1]["choices"] == [] and asked[-1]["usage"]["completion_tokens"] == 4
    completion = client.post("/v1/completions", json={"model": "llama-3.1-8b", "prompt": PROMPT, "max_tokens": 3,
                                                      "stream": True}).text
    assert '"usage"' not in completion  # compact completion chunks: no "usage": null any more


def test_clamping_follows_the_field_vllm_obeys(client: httpx.Client) -> None:
    clamped = client.post("/v1/chat/completions", json=_chat(max_tokens=50, ignore_eos=True))
    assert clamped.headers["x-decode-clamped"] == "50"
    assert clamped.json()["usage"]["completion_tokens"] == 8  # the lane's maxOutputTokens
    both = client.post("/v1/chat/completions", json=_chat(max_tokens=50, max_completion_tokens=3, ignore_eos=True))
    assert "x-decode-clamped" not in both.headers and both.json()["usage"]["completion_tokens"] == 3
    over = client.post("/v1/chat/completions", json=_chat(max_tokens=2, max_completion_tokens=50, ignore_eos=True))
    assert over.headers["x-decode-clamped"] == "50" and over.json()["usage"]["completion_tokens"] == 8
    zero = client.post("/v1/chat/completions", json=_chat(max_tokens=5, max_completion_tokens=0))
    assert zero.status_code == 400  # 0 is not null, so vLLM takes it (and refuses it), not max_tokens
    assert zero.json()["error"]["code"] == 400
    default = client.post("/v1/completions", json={"model": "llama-3.1-8b", "prompt": PROMPT, "ignore_eos": True})
    assert default.json()["usage"]["completion_tokens"] == 4  # defaultMaxTokens injected (vLLM's own is 16)


def test_cache_salt_keeps_prefixes_apart(client: httpx.Client) -> None:
    long_prompt = " ".join(f"item{i}" for i in range(120))  # several KV blocks

    def hits() -> float:
        return _metric(client.get("/metrics").text, "vllm:prefix_cache_hits_total")

    def ask(salt: str) -> None:
        body = {"model": "llama-3.1-8b", "prompt": long_prompt, "max_tokens": 1, "cache_salt": salt}
        assert client.post("/v1/completions", json=body).status_code == 200

    ask("tenant-a")
    before = hits()
    ask("tenant-a")
    after_same = hits()
    ask("tenant-b")
    after_other = hits()
    assert after_same > before  # the same salt hits the cached prefix
    assert after_other == after_same  # another salt never does
    bad = client.post("/v1/completions", json={"model": "llama-3.1-8b", "prompt": "x", "max_tokens": 1,
                                                "cache_salt": ""})
    assert bad.status_code == 400 and "error" in bad.json()  # vLLM's own refusal, relayed


def test_priority_is_relayed_and_vllms_answer_kept(client: httpx.Client) -> None:
    ok = client.post("/v1/chat/completions", json=_chat(max_tokens=1, priority=3), headers={"x-priority": "batch"})
    assert ok.status_code == 200
    bad = client.post("/v1/chat/completions", json=_chat(max_tokens=1, priority="high"))
    assert bad.status_code == 400 and bad.json()["error"]["code"] == 400


def test_the_api_key_guards_vllms_prefixes_only(state: dict[str, Any]) -> None:
    with httpx.Client(base_url=state["proxy_url"], timeout=60.0) as bare:
        refused = bare.post("/v1/chat/completions", json=_chat(max_tokens=1))
        assert (refused.status_code, refused.json()) == (401, {"error": "Unauthorized"})
        assert bare.get("/ready").status_code == 200  # vLLM's /health is open
        assert bare.get("/metrics").status_code == 200
    with httpx.Client(base_url=state["engine_url"], timeout=60.0) as engine:
        for path in Contract.load(LATEST).guarded_prefixes:
            assert engine.post(path + "/anything", json={}).status_code == 401, path
        assert engine.post("/tokenize", json={"prompt": "x"}).status_code == 200


def test_the_relayed_metrics_are_what_the_record_and_the_autoscaler_name(client: httpx.Client) -> None:
    text = client.get("/metrics").text
    relayed = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line.startswith("vllm:")}
    recorded = {s for m in Contract.load(LATEST).metrics for s in m["samples"]}
    assert recorded <= relayed, sorted(recorded - relayed)
    sample = parse_metrics(text, pod="lane", at=0.0)
    assert sample.kv_cache_usage is not None and sample.engine_running is not None
    assert sample.engine_waiting is not None


def test_the_proxys_ttft_and_itl_histograms_measure_real_streams(client: httpx.Client) -> None:
    name = "decode_proxy:time_to_first_token_seconds_count"
    before = _metric(client.get("/metrics").text, name)
    itl_before = _metric(client.get("/metrics").text, "decode_proxy:inter_token_latency_seconds_count")
    events = _events(client.post("/v1/chat/completions", json=_chat(max_tokens=6, stream=True,
                                                                    ignore_eos=True)).text)
    tokens = sum(1 for e in events if e["choices"] and e["choices"][0]["delta"].get("content"))
    # The proxy records a request once its last byte is sent; the client, holding that byte, can ask
    # /metrics first (uvicorn takes the next request on the connection then), so wait a moment for it.
    deadline = time.monotonic() + 5
    while _metric(text := client.get("/metrics").text, name) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _metric(text, name) == before + 1
    assert _metric(text, "decode_proxy:inter_token_latency_seconds_count") - itl_before == tokens - 1
    assert re.search(r'decode_proxy:slo_attainment_ratio\{class="interactive",objective="ttft"\} ', text)


def test_the_proxy_says_503_once_vllm_dies(state: dict[str, Any]) -> None:
    os.kill(state["engine_pid"], signal.SIGKILL)
    with httpx.Client(base_url=state["proxy_url"], timeout=10.0) as bare:
        deadline = time.monotonic() + 60
        while bare.get("/ready").status_code != 503:
            assert time.monotonic() < deadline, "the proxy still says ready with its engine dead"
            time.sleep(0.2)
        refused = bare.post("/v1/chat/completions", json=_chat(max_tokens=1))
    assert refused.status_code == 503 and "error" in refused.json()
