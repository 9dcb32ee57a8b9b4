"""The proxy in front of the real engine server (bundled model), both on loopback."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from decodeservice.engine import SamplingParams
from tests.conftest import ModelBundle
from tests.engine.test_server_harness import RunningServer, running_server
from tests.proxy.conftest import running_proxy

ENGINE_CONFIG = {"max_num_seqs": 8, "kv_cache_gib": 0.25, "max_model_len": 2048}
POLICY = {"outputLength": {"maxOutputTokens": 8, "mode": "clamp", "defaultMaxTokens": 6}}


@pytest.fixture(scope="module")
def engine_server(bundled: ModelBundle) -> Iterator[RunningServer]:
    with running_server(lambda: bundled.engine(**ENGINE_CONFIG)) as running:
        yield running


async def test_stream_through_proxy_equals_engine(bundled: ModelBundle, engine_server: RunningServer) -> None:
    messages = [{"role": "user", "content": "Name three colors."}]
    prompt = bundled.tokenizer.apply_chat_template(messages)
    expected = bundled.engine(**ENGINE_CONFIG).generate(
        prompt, SamplingParams(max_tokens=8, temperature=0.0))[0].text

    async with running_proxy(POLICY, engine_server.url) as (_, client):
        client.timeout = httpx.Timeout(120.0)
        body = {"model": "smollm2-135m", "messages": messages, "max_tokens": 50, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        pieces: list[str] = []
        usage = None
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            assert response.headers["x-decode-clamped"] == "50"  # clamped to the policy's cap of 8
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices", []):
                    pieces.append(choice["delta"].get("content") or "")
        assert "".join(pieces) == expected
        assert usage is not None and usage["completion_tokens"] <= 8

        # No limit sent: the policy's default is injected.
        response = await client.post("/v1/completions", json={
            "model": "smollm2-135m", "prompt": "Once upon a time", "temperature": 0, "ignore_eos": True})
        assert response.status_code == 200
        assert response.json()["usage"]["completion_tokens"] == 6

        metrics = (await client.get("/metrics")).text
        assert "decode_proxy:" in metrics
