"""Output length policy: clamp, reject, default injection, max input tokens (through the real proxy)."""

from __future__ import annotations

import json
from typing import Any

from tests.support.fake_engine import FakeEngine

CLAMP = {"outputLength": {"maxOutputTokens": 8, "defaultMaxTokens": 4, "mode": "clamp"}}
REJECT = {"outputLength": {"maxOutputTokens": 8, "defaultMaxTokens": 4, "mode": "reject"}}


def _text(sse: str) -> str:
    out = []
    for line in sse.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.extend(c.get("text", "") for c in json.loads(line[6:])["choices"])
    return "".join(out)


async def test_clamp_rewrites_both_limits_and_sets_header(engine: FakeEngine, proxy: Any) -> None:
    async with proxy(CLAMP, engine.url) as (_, client):
        r = await client.post("/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 100, "max_completion_tokens": 50,
        })
    assert r.status_code == 200, r.text
    assert r.headers["x-decode-clamped"] == "50"  # the limit the engine obeys: max_completion_tokens
    assert engine.received[-1]["max_tokens"] == 8
    assert engine.received[-1]["max_completion_tokens"] == 8
    assert r.json()["usage"]["completion_tokens"] == 8


async def test_max_completion_tokens_wins_whenever_given(engine: FakeEngine, proxy: Any) -> None:
    """vLLM from 0.30 (and the builtin engine) obey max_completion_tokens when it is not null, 0 included:
    a max_tokens above the cap beside it is lowered, but nothing was clamped that the engine would obey."""
    async with proxy(CLAMP, engine.url) as (app, client):
        r = await client.post("/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100,
            "max_completion_tokens": 5})
        metrics = (await client.get("/metrics")).text
    assert r.status_code == 200, r.text
    assert "x-decode-clamped" not in r.headers
    assert engine.received[-1]["max_tokens"] == 8 and engine.received[-1]["max_completion_tokens"] == 5
    assert 'decode_proxy:requests_clamped_total{class="interactive"} 0.0' in metrics


async def test_a_completion_obeys_max_tokens_alone(engine: FakeEngine, proxy: Any) -> None:
    """Neither engine has max_completion_tokens on /v1/completions: it is an ignored extra field there."""
    async with proxy(CLAMP, engine.url) as (_, client):
        both = await client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2,
                                                          "max_completion_tokens": 90})
        only = await client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_completion_tokens": 3})
    assert "x-decode-clamped" not in both.headers and only.status_code == 200
    assert engine.received[0]["max_tokens"] == 2 and engine.received[0]["max_completion_tokens"] == 8
    assert engine.received[1]["max_tokens"] == 4  # no limit the engine reads: defaultMaxTokens injected


async def test_reject_judges_the_limit_the_engine_obeys(engine: FakeEngine, proxy: Any) -> None:
    async with proxy(REJECT, engine.url) as (_, client):
        ok = await client.post("/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100,
            "max_completion_tokens": 5})
        over = await client.post("/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
            "max_completion_tokens": 100})
    assert ok.status_code == 200, ok.text
    assert engine.received[-1]["max_tokens"] == 8  # lowered, not refused: the engine reads the other field
    assert over.status_code == 400 and over.json()["error"]["param"] == "max_completion_tokens"


async def test_clamp_streaming_generates_only_the_cap(engine: FakeEngine, proxy: Any) -> None:
    async with proxy(CLAMP, engine.url) as (_, client):
        r = await client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 99, "stream": True})
    assert r.status_code == 200
    assert r.headers["x-decode-clamped"] == "99"
    assert _text(r.text) == "".join(f" t{i}" for i in range(8))


async def test_within_cap_is_untouched(engine: FakeEngine, proxy: Any) -> None:
    async with proxy(CLAMP, engine.url) as (_, client):
        r = await client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 3})
    assert r.status_code == 200
    assert "x-decode-clamped" not in r.headers
    assert engine.received[-1]["max_tokens"] == 3


async def test_reject_answers_400_openai_error_and_never_reaches_upstream(engine: FakeEngine, proxy: Any) -> None:
    async with proxy(REJECT, engine.url) as (app, client):
        r = await client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 9})
        metrics = (await client.get("/metrics")).text
    assert r.status_code == 400
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == "max_tokens" and error["type"] == "invalid_request_error"
    assert "8" in error["message"]
    assert engine.received == []
    assert 'decode_proxy:requests_rejected_total{reason="max_tokens"} 1.0' in metrics


async def test_default_is_injected_when_no_limit(engine: FakeEngine, proxy: Any) -> None:
    async with proxy(REJECT, engine.url) as (_, client):
        r = await client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": None})
    assert r.status_code == 200
    assert engine.received[-1]["max_tokens"] == 4
    assert r.json()["usage"]["completion_tokens"] == 4


async def test_bad_limit_types_are_400(engine: FakeEngine, proxy: Any) -> None:
    async with proxy(CLAMP, engine.url) as (_, client):
        for bad in ("12", 1.5, True, -1, [3]):
            r = await client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": bad})
            assert r.status_code == 400, bad
            assert r.json()["error"]["param"] == "max_tokens"
    assert engine.received == []


async def test_max_input_tokens_counted_by_upstream_tokenize(engine: FakeEngine, proxy: Any) -> None:
    policy = {"outputLength": {"maxInputTokens": 3}}
    async with proxy(policy, engine.url) as (_, client):
        ok = await client.post("/v1/completions", json={"model": "m", "prompt": "one two three"})
        over = await client.post("/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "one two"}, {"role": "user", "content": "x y"}],
        })
    assert ok.status_code == 200
    assert over.status_code == 400
    assert over.json()["error"]["param"] == "messages"
    assert "4 tokens" in over.json()["error"]["message"]
    assert len(engine.received) == 1


async def test_max_input_tokens_with_token_ids(engine: FakeEngine, proxy: Any) -> None:
    async with proxy({"outputLength": {"maxInputTokens": 3}}, engine.url) as (_, client):
        over = await client.post("/v1/completions", json={"model": "m", "prompt": [1, 2, 3, 4]})
        bad = await client.post("/v1/completions", json={"model": "m", "prompt": {"a": 1}})
    assert over.status_code == 400 and "4 tokens" in over.json()["error"]["message"]
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"


async def test_max_input_tokens_with_a_local_tokenizer(engine: FakeEngine, proxy: Any, tmp_path: Any) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    async with proxy({"outputLength": {"maxInputTokens": 2}}, engine.url, tokenizer_path=str(path)) as (_, client):
        ok = await client.post("/v1/completions", json={"model": "m", "prompt": "a b"})
        over = await client.post("/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a b a"}]}],
        })
    assert ok.status_code == 200
    assert over.status_code == 400 and "3 tokens" in over.json()["error"]["message"]
