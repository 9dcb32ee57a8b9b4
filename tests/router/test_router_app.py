"""The router over real loopback servers: relaying, errors, metrics, agreement and isolation."""

from __future__ import annotations

import json

import httpx

from tests.router.conftest import chat, fake_engines, metric, running_router

DOC = "A document about routers and caches. " * 70  # about 650 tokens


async def test_sse_is_relayed_byte_for_byte() -> None:
    async with fake_engines(1, tokens_per_chunk=2) as (engine,), running_router([engine.url]) as (_, client):
        body = chat("hello", max_tokens=9) | {"stream_options": {"include_usage": True}}
        async with httpx.AsyncClient() as direct:
            expected = (await direct.post(engine.url + "/v1/chat/completions", json=body)).content
        response = await client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.content == expected
        assert response.content.endswith(b"data: [DONE]\n\n")
        assert engine.received[-1] == body  # the body went through unchanged
        completion = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert completion.status_code == 200 and completion.json()["choices"][0]["text"] == " t0 t1"


async def test_bad_input_gets_the_proxys_openai_errors() -> None:
    async with fake_engines(1) as (engine,), \
            running_router([engine.url], policy={"outputLength": {"maxBodyBytes": 2000}}) as (app, client):
        cases = [
            (await client.post("/v1/chat/completions", content=b"{not json"), 400, None),
            (await client.post("/v1/chat/completions", json={"messages": "hi"}), 400, "messages"),
            (await client.post("/v1/completions", json={"prompt": {"a": 1}}), 400, "prompt"),
            (await client.post("/v1/chat/completions", json=chat("x"), headers={"x-priority": "urgent"}), 400,
             "x-priority"),
            (await client.post("/v1/completions", json={"prompt": "x" * 5000}), 413, None),
        ]
        for response, status, param in cases:
            assert response.status_code == status, response.text
            error = response.json()["error"]
            assert error["type"] == "invalid_request_error" and error["param"] == param
        assert (await client.get("/v1/chat/completions")).status_code == 405
        assert engine.received == []  # nothing invalid reached an endpoint
        text = (await client.get("/metrics")).text
        assert metric(text, "decode_router:requests_total", status="400") == 4
        assert metric(text, "decode_router:requests_total", status="413") == 1


async def test_models_health_ready_and_metrics() -> None:
    async with fake_engines(2) as engines, running_router([e.url for e in engines]) as (_, client):
        assert (await client.get("/health")).json() == {"status": "ok"}
        assert (await client.get("/ready")).status_code == 200
        assert (await client.get("/v1/models")).json()["data"][0]["id"] == "fake-model"
        before = metric((await client.get("/metrics")).text, "decode_router:last_request_timestamp_seconds")
        assert before == 0
        body = chat(DOC) | {"stream_options": {"include_usage": True}}
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
        text = (await client.get("/metrics")).text
        assert metric(text, "decode_router:endpoints", state="ready") == 2
        assert metric(text, "decode_router:endpoints", state="known") == 2
        assert metric(text, "decode_router:last_request_timestamp_seconds") > 1e9
        assert metric(text, "decode_router:requests_total", **{"class": "interactive", "status": "200"}) == 1
        assert metric(text, "decode_router:time_to_first_token_seconds_count", **{"class": "interactive"}) == 1
        assert metric(text, "decode_router:predicted_ttft_seconds_count", **{"class": "interactive"}) == 1
        assert metric(text, "decode_router:prompt_tokens_total") == 1  # the fake engine's usage says 1
        assert sum(metric(text, "decode_router:decisions_total", endpoint=e.url, reason="rendezvous")
                   for e in engines) == 1


async def test_a_conversations_next_turn_follows_its_cached_prefix() -> None:
    async with fake_engines(3) as engines, running_router([e.url for e in engines]) as (app, client):
        for n in range(6):
            first = chat(f"conversation {n}: " + DOC)
            assert (await client.post("/v1/chat/completions", json=first)).status_code == 200
            served = [e for e in engines if e.received and e.received[-1] == first]
            later = first | {"messages": [*first["messages"], {"role": "assistant", "content": "ok"},
                                          {"role": "user", "content": "more?"}]}
            assert (await client.post("/v1/chat/completions", json=later)).status_code == 200
            assert served[0].received[-1] == later
        text = (await client.get("/metrics")).text
        hits = sum(metric(text, "decode_router:decisions_total", endpoint=e.url, reason="prefix_hit_within_slo")
                   for e in engines)
        assert hits == 6
        assert metric(text, "decode_router:prefix_tokens_predicted_total") > 6 * 500


async def test_two_routers_agree_on_cold_prefixes_without_shared_state() -> None:
    async with fake_engines(3) as engines:
        urls = [e.url for e in engines]
        async with running_router(urls) as (_, a), running_router(list(reversed(urls))) as (_, b):
            for n in range(12):
                body = chat(f"conversation {n}: " + DOC)
                for client in (a, b):
                    assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
                got = [e for e in engines for r in e.received if r == body]
                assert len(got) == 2 and got[0] is got[1], f"conversation {n} split between endpoints"
        assert sum(1 for e in engines if e.received) >= 2  # and they are spread, not piled on one


async def test_an_isolated_tenant_never_hits_another_tenants_blocks() -> None:
    policy = {"admission": {"isolatePrefixCache": True}}
    async with fake_engines(2) as engines, \
            running_router([e.url for e in engines], policy=policy) as (app, client):
        body = chat(DOC)
        for tenant in ("acme", "acme", "globex"):
            response = await client.post("/v1/chat/completions", json=body, headers={"x-tenant": tenant})
            assert response.status_code == 200
        text = (await client.get("/metrics")).text
        reasons = {r: sum(metric(text, "decode_router:decisions_total", endpoint=e.url, reason=r) for e in engines)
                   for r in ("rendezvous", "prefix_hit_within_slo")}
        assert reasons == {"rendezvous": 2, "prefix_hit_within_slo": 1}  # acme's second turn only
        assert all("cache_salt" not in json.dumps(r) for e in engines for r in e.received)  # the proxy sets it
