"""The proxy in front of vLLM, as `engine.kind: vllm` deploys it, against the recorded-contract stand-in.

`decodectl proxy --engine-kind vllm` (what the operator renders) must become Ready through its own
/ready and stream a clamped chat completion; the policies that talk to the engine (the prompt count
through vLLM's /tokenize, the relay of its `vllm:` series, usage) must work with vLLM's real shapes.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from decodeservice.operator.autoscaler.scrape import parse_metrics
from decodeservice.operator.manifests import render
from tests.support.fake_engine import serve_loopback
from tests.support.vllm_standin import VERSIONS, Contract, VllmStandIn

ROOT = Path(__file__).resolve().parents[2]
CAP = {"outputLength": {"maxOutputTokens": 6, "defaultMaxTokens": 4}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _rendered_proxy(policies: dict[str, Any]) -> tuple[list[str], str, str]:
    """The proxy container's args, its policy.yaml and the engine image of examples/vllm-proxy.yaml,
    with `policies` set over the example's own."""
    body = yaml.safe_load((ROOT / "examples" / "vllm-proxy.yaml").read_text())
    body["spec"]["policies"] = {**body["spec"].get("policies", {}), **policies}
    children = render(body)
    pod = children.deployment["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in pod["containers"]}
    return containers["proxy"]["args"], children.config_map["data"]["policy.yaml"], containers["engine"]["image"]


def _set(args: list[str], flag: str, value: str) -> list[str]:
    i = args.index(flag)
    return [*args[:i + 1], value, *args[i + 2:]]


async def _ready_within(client: httpx.AsyncClient, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> float:
    """Poll the proxy's /ready as the kubelet's readiness probe does; seconds until it said 200."""
    started = deadline = time.monotonic()
    deadline += timeout
    while True:
        assert proc.poll() is None, "proxy process exited early"
        try:
            if (await client.get("/ready")).status_code == 200:
                return time.monotonic() - started
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the proxy never became Ready in front of vLLM"
        await asyncio.sleep(0.05)


async def _stream_clamped_chat(client: httpx.AsyncClient, standin: VllmStandIn) -> None:
    body = {"model": standin.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 500,
            "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["x-decode-clamped"] == "500"
        events = [line.removeprefix("data: ") async for line in response.aiter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    content = [c["choices"][0]["delta"]["content"] for c in chunks if c["choices"] and c["choices"][0]["delta"]]
    assert content == ["", " t0", " t1", " t2", " t3", " t4", " t5"]  # the role chunk, then the cap's 6 tokens
    assert chunks[-1]["usage"]["completion_tokens"] == 6
    assert standin.received[-1]["max_tokens"] == 6


async def _run_proxy(argv: list[str], standin: VllmStandIn, tmp_path: Path) -> None:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-P", "-m", "decodeservice.cli.main", *argv, "--port", str(port),
                             "--log-level", "warning"], env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10.0) as client:
            await _ready_within(client, proc)
            await _stream_clamped_chat(client, standin)
    finally:
        proc.terminate()
        proc.wait(timeout=15)
    assert ("GET", "/health", 200) in standin.requests
    assert all(path != "/ready" for _, path, _ in standin.requests)


async def test_decodectl_proxy_engine_kind_vllm_becomes_ready_and_streams_clamped(tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(yaml.safe_dump(CAP))
    standin = VllmStandIn()
    async with serve_loopback(standin.app()) as url:
        await _run_proxy(["proxy", "--upstream", url, "--engine-kind", "vllm", "--host", "127.0.0.1",
                          "--policy", str(policy)], standin, tmp_path)


async def test_the_proxy_as_the_operator_renders_it_for_vllm(tmp_path: Path) -> None:
    args, policy_yaml, image = _rendered_proxy(CAP)
    assert args[args.index("--engine-kind") + 1] == "vllm"  # what the operator renders for engine.kind vllm
    assert "maxInflight: 256" in policy_yaml  # the example's own policies, the output cap lowered
    version = image.rsplit(":", 1)[1].removeprefix("v")
    assert version in VERSIONS, f"no contract for {image}: run scripts/record_vllm_contract.py for vLLM {version}"
    policy = tmp_path / "policy.yaml"
    policy.write_text(policy_yaml)
    standin = VllmStandIn(contract=Contract.load(version))
    async with serve_loopback(standin.app()) as url:
        args = _set(_set(_set(args, "--upstream", url), "--host", "127.0.0.1"), "--policy", str(policy))
        args = [a for i, a in enumerate(args) if a != "--port" and (i == 0 or args[i - 1] != "--port")]
        await _run_proxy(args, standin, tmp_path)


@pytest.mark.parametrize("version", VERSIONS)
async def test_clamped_chat_stream_in_process(version: str, proxy: Any) -> None:
    standin = VllmStandIn(contract=Contract.load(version))
    async with serve_loopback(standin.app()) as url, proxy(CAP, url, engine_kind="vllm") as (app, client):
        assert (await client.get("/ready")).status_code == 200
        await _stream_clamped_chat(client, standin)
        metrics = (await client.get("/metrics")).text
    assert 'decode_proxy:generation_tokens_total{class="interactive"} 6.0' in metrics  # from vLLM's usage chunk


@pytest.mark.parametrize("version", VERSIONS)
async def test_max_completion_tokens_is_the_limit_vllm_obeys(version: str, proxy: Any) -> None:
    standin = VllmStandIn(contract=Contract.load(version))
    body = {"model": standin.model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 90,
            "max_completion_tokens": 3}
    async with serve_loopback(standin.app()) as url, proxy(CAP, url, engine_kind="vllm") as (_, client):
        response = await client.post("/v1/chat/completions", json=body)
        over = await client.post("/v1/chat/completions", json={**body, "max_tokens": 2, "max_completion_tokens": 90})
    assert response.status_code == 200 and "x-decode-clamped" not in response.headers  # vLLM obeys the 3
    assert response.json()["usage"]["completion_tokens"] == 3
    assert standin.received[0]["max_tokens"] == 6  # lowered anyway, uncounted
    assert over.headers["x-decode-clamped"] == "90" and over.json()["usage"]["completion_tokens"] == 6


@pytest.mark.parametrize("version", VERSIONS)
async def test_a_stream_has_usage_only_when_include_usage_asks(version: str, proxy: Any) -> None:
    standin = VllmStandIn(contract=Contract.load(version))
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "stream": True}
    async with serve_loopback(standin.app()) as url, proxy(CAP, url, engine_kind="vllm") as (_, client):
        bare = (await client.post("/v1/chat/completions", json={**body, "stream_options": {}})).text
        asked = (await client.post("/v1/chat/completions",
                                   json={**body, "stream_options": {"include_usage": True}})).text
        metrics = (await client.get("/metrics")).text
    assert '"usage"' not in bare  # include_usage defaults to false inside stream_options from 0.30 on
    assert '"usage":{' in asked
    assert 'decode_proxy:generation_tokens_total{class="interactive"} 6.0' in metrics  # events, then usage


@pytest.mark.parametrize("version", VERSIONS)
async def test_a_reasoning_models_thinking_starts_its_stream(version: str, proxy: Any) -> None:
    """TTFT and ITL run from the first reasoning delta (the client is served from then on), not from the
    first visible token."""
    standin = VllmStandIn(contract=Contract.load(version), reasoning_tokens=3)
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 5, "stream": True}
    async with serve_loopback(standin.app()) as url, proxy(CAP, url, engine_kind="vllm") as (_, client):
        text = (await client.post("/v1/chat/completions", json=body)).text
        metrics = (await client.get("/metrics")).text
    assert f'"{standin.contract.reasoning_field}":" r0"' in text and standin.contract.reasoning_field == "reasoning"
    assert 'decode_proxy:inter_token_latency_seconds_count{class="interactive"} 4.0' in metrics  # 5 events
    assert 'decode_proxy:generation_tokens_total{class="interactive"} 5.0' in metrics


async def test_non_streamed_answers_do_not_count_against_the_ttft_objective(proxy: Any) -> None:
    standin = VllmStandIn()
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    async with serve_loopback(standin.app()) as url, proxy(CAP, url, engine_kind="vllm") as (_, client):
        for _ in range(3):
            assert (await client.post("/v1/chat/completions", json={**body, "stream": True})).status_code == 200
        for _ in range(2):
            assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
        metrics = (await client.get("/metrics")).text
    assert 'decode_proxy:slo_attainment_ratio{class="interactive",objective="ttft"} 1.0' in metrics
    assert 'decode_proxy:slo_requests_total{class="interactive",objective="ttft",outcome="met"} 3.0' in metrics
    assert 'decode_proxy:e2e_request_latency_seconds_count{class="interactive"} 5.0' in metrics


@pytest.mark.parametrize("version", VERSIONS)
async def test_vllms_api_key_guards_its_prefixes_and_the_proxy_passes_the_key(version: str, proxy: Any) -> None:
    standin = VllmStandIn(contract=Contract.load(version), api_key="k")
    policy = {"outputLength": {"maxInputTokens": 100}}  # the prompt count asks vLLM's /tokenize, unguarded
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    async with serve_loopback(standin.app()) as url, proxy(policy, url, engine_kind="vllm") as (_, client):
        ready = await client.get("/ready")
        bare = await client.post("/v1/chat/completions", json=body)
        keyed = await client.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer k"})
        models = await client.get("/v1/models", headers={"Authorization": "Bearer k"})
    assert ready.status_code == 200  # /health is not under a guarded prefix
    assert (bare.status_code, bare.json()) == (401, {"error": "Unauthorized"})  # vLLM's own answer, relayed
    assert keyed.status_code == 200 and models.status_code == 200
    assert set(standin.contract.guarded_prefixes) == {"/v1", "/v2", "/inference", "/cohere"}


@pytest.mark.parametrize("version", VERSIONS)
async def test_the_prompt_is_counted_by_vllms_tokenize(version: str, proxy: Any) -> None:
    standin = VllmStandIn(contract=Contract.load(version))
    policy = {"outputLength": {"maxInputTokens": 8}}
    async with serve_loopback(standin.app()) as url, proxy(policy, url, engine_kind="vllm") as (_, client):
        ok = await client.post("/v1/completions", json={"prompt": "a b c", "max_tokens": 1})
        long = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a b c"}],
                                                               "max_tokens": 1})
    assert ok.status_code == 200  # 3 words + BOS
    assert long.status_code == 400  # 3 words + the chat template's tokens (9)
    assert long.json()["error"]["message"].startswith("the prompt has 9 tokens")
    assert {"prompt": "a b c"} in standin.received and {"messages": [{"role": "user", "content": "a b c"}]} in \
        standin.received


async def test_a_chats_tools_are_counted_with_its_prompt(proxy: Any) -> None:
    standin = VllmStandIn()
    tools = [{"type": "function", "function": {"name": "f", "description": "a b c d e f g h"}}]
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools, "max_tokens": 1}
    policy = {"outputLength": {"maxInputTokens": 10}}
    async with serve_loopback(standin.app()) as url, proxy(policy, url, engine_kind="vllm") as (_, client):
        response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400  # 7 for the message and template, 14 more for the tools
    assert response.json()["error"]["message"].startswith("the prompt has 21 tokens")
    assert standin.received[0] == {"messages": body["messages"], "tools": tools}


@pytest.mark.parametrize("version", VERSIONS)
async def test_vllm_series_are_relayed_for_the_autoscaler(version: str, proxy: Any) -> None:
    standin = VllmStandIn(contract=Contract.load(version), kv_cache_usage=0.375)
    async with serve_loopback(standin.app()) as url, proxy({}, url, engine_kind="vllm") as (_, client):
        text = (await client.get("/metrics")).text
    relayed = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line.startswith("vllm:")}
    expected = {s for m in standin.contract.metrics for s in m["samples"]}
    assert relayed == expected  # every vllm: sample vLLM exposes, under its own name
    assert "http_requests_total" not in text  # vLLM's other series stay behind
    sample = parse_metrics(text, pod="p", at=0.0)
    assert (sample.kv_cache_usage, sample.engine_running, sample.engine_waiting) == (0.375, 0.0, 0.0)


@pytest.mark.parametrize("version", VERSIONS)
async def test_vllm_errors_pass_through_in_its_own_shape(version: str, proxy: Any) -> None:
    standin = VllmStandIn(contract=Contract.load(version))
    async with serve_loopback(standin.app()) as url, proxy({}, url, engine_kind="vllm") as (_, client):
        wrong = await client.post("/v1/chat/completions", json={"model": "other", "messages": [], "max_tokens": 1})
        models = await client.get("/v1/models")
    assert wrong.status_code == 404
    assert wrong.json() == standin.contract.error_body("The model `other` does not exist.", err_type="NotFoundError",
                                                       code=404)
    assert models.json()["data"][0]["id"] == standin.model


@pytest.mark.parametrize("version", VERSIONS)
async def test_an_error_event_mid_stream_is_not_a_met_slo(version: str, proxy: Any) -> None:
    standin = VllmStandIn(contract=Contract.load(version), fail_mid_stream_after=2)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True}
    async with serve_loopback(standin.app()) as url, proxy({}, url, engine_kind="vllm") as (_, client):
        response = await client.post("/v1/chat/completions", json=body)
        metrics = (await client.get("/metrics")).text
    events = [e.removeprefix("data: ") for e in response.text.split("\n\n") if e]
    assert json.loads(events[-2]) == standin.contract.error_body("engine step failed")  # relayed as vLLM sent it
    assert 'decode_proxy:upstream_errors_total{kind="error_event"} 1.0' in metrics
    assert 'decode_proxy:e2e_request_latency_seconds_count{class="interactive"} 0.0' in metrics


@pytest.mark.parametrize("version", VERSIONS)
async def test_a_completion_stream_without_usage_is_counted_by_its_token_events(version: str, proxy: Any) -> None:
    standin = VllmStandIn(contract=Contract.load(version))
    async with serve_loopback(standin.app()) as url, proxy(CAP, url, engine_kind="vllm") as (_, client):
        response = await client.post("/v1/completions", json={"prompt": "x", "stream": True})
        metrics = (await client.get("/metrics")).text
    chunks = [e for e in response.text.split("\n\n") if e]
    assert chunks[-1] == "data: [DONE]" and not any('"usage"' in c for c in chunks[:-1])  # compact chunks
    assert standin.received[-1]["max_tokens"] == 4  # defaultMaxTokens injected: vLLM's own default is 16
    assert 'decode_proxy:generation_tokens_total{class="interactive"} 4.0' in metrics
