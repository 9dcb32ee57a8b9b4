"""Body parsing: 413 before the upstream, malformed JSON and bad headers as 400, never a 500."""

from __future__ import annotations

from typing import Any

from tests.support.fake_engine import FakeEngine

SMALL = {"outputLength": {"maxBodyBytes": 200}}


def _is_openai_error(body: Any) -> bool:
    return isinstance(body, dict) and set(body.get("error", {})) == {"message", "type", "param", "code"}


async def test_oversized_body_is_413_and_not_forwarded(engine: FakeEngine, proxy: Any) -> None:
    async with proxy(SMALL, engine.url) as (_, client):
        r = await client.post("/v1/completions", json={"model": "m", "prompt": "x" * 500})

        async def chunks() -> Any:  # no Content-Length: the limit is enforced while reading
            for _ in range(10):
                yield b"x" * 50

        chunked = await client.post("/v1/completions", content=chunks())
        fits = await client.post("/v1/completions", json={"model": "m", "prompt": "x" * 100})
    assert r.status_code == 413 and _is_openai_error(r.json())
    assert "200 bytes" in r.json()["error"]["message"]
    assert chunked.status_code == 413
    assert fits.status_code == 200
    assert len(engine.received) == 1


async def test_malformed_input_is_400_never_500(engine: FakeEngine, proxy: Any) -> None:
    bad_bodies = [b"{not json", b"[1, 2]", b'"a string"', b"\xff\xfe\x00", b"", b'{"stream": "yes"}']
    async with proxy({}, engine.url) as (_, client):
        for body in bad_bodies:
            r = await client.post("/v1/chat/completions", content=body,
                                  headers={"content-type": "application/json"})
            assert r.status_code == 400, (body, r.text)
            assert _is_openai_error(r.json())
        r = await client.post("/v1/completions", json={"prompt": "x"}, headers={"x-priority": "urgent"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "x-priority"
        r = await client.get("/v1/completions")
        assert r.status_code == 405 and _is_openai_error(r.json())
    assert engine.received == []


async def test_priority_header_selects_class(engine: FakeEngine, proxy: Any) -> None:
    async with proxy({"admission": {"defaultClass": "batch"}}, engine.url) as (_, client):
        await client.post("/v1/completions", json={"prompt": "x"})
        await client.post("/v1/completions", json={"prompt": "x"}, headers={"x-priority": "Interactive"})
        text = (await client.get("/metrics")).text
    assert 'decode_proxy:requests_total{class="batch",status="200"} 1.0' in text
    assert 'decode_proxy:requests_total{class="interactive",status="200"} 1.0' in text
