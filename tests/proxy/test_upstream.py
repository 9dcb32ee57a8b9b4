"""Streaming pass-through and the upstream failure cases, observed at the client and at the fake engine."""

from __future__ import annotations

import json
import socket
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from decodeservice.proxy.upstream import make_client
from tests.support.fake_engine import FakeEngine, serve_loopback


def _free_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def _events(lines: list[str]) -> list[Any]:
    return [json.loads(x[6:]) if x != "data: [DONE]" else "[DONE]" for x in lines if x.startswith("data: ")]


async def test_sse_is_relayed_before_the_upstream_finishes(engine: FakeEngine, proxy: Any) -> None:
    engine.itl_s = 0.05
    async with proxy({}, engine.url) as (_, client):
        body = {"model": "m", "prompt": "x", "max_tokens": 40, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            lines = r.aiter_lines()
            first = await anext(line async for line in lines if line.startswith("data: "))
            # The first token reached us while the engine is still generating: nothing was buffered.
            assert engine.active == 1 and engine.completed == 0
            rest = [line async for line in lines]
    events = _events([first, *rest])
    assert events[-1] == "[DONE]"
    assert [e["choices"][0]["text"] for e in events[:-1]] == [f" t{i}" for i in range(40)]


async def test_client_disconnect_cancels_the_upstream_stream(engine: FakeEngine, proxy: Any) -> None:
    engine.itl_s = 0.02
    async with proxy({}, engine.url) as (app, client):
        body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2000, "stream": True}
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            async for line in r.aiter_lines():
                if '"content": " t1"' in line:
                    break
        await engine.wait_for(lambda e: e.cancelled == 1, timeout=5.0)
        assert engine.completed == 0
        admission = app.state.admission
        await engine.wait_for(lambda _: admission.gate.inflight == 0, timeout=5.0)
        text = (await client.get("/metrics")).text
    assert 'decode_proxy:requests_total{class="interactive",status="499"} 1.0' in text


async def test_unreachable_upstream_is_503_with_retry_after(proxy: Any) -> None:
    async with proxy({}, _free_port_url()) as (_, client):
        r = await client.post("/v1/completions", json={"model": "m", "prompt": "x", "stream": True})
        models = await client.get("/v1/models")
        ready = await client.get("/ready")
        text = (await client.get("/metrics")).text
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "upstream_unavailable"
    assert models.status_code == 503
    assert ready.status_code == 503 and "error" in ready.json()
    assert 'decode_proxy:upstream_errors_total{kind="unreachable"} 2.0' in text


async def test_upstream_dying_mid_stream_ends_with_an_error_event(engine: FakeEngine, proxy: Any) -> None:
    engine.die_after_tokens = 3
    async with proxy({}, engine.url) as (_, client):
        body = {"model": "m", "prompt": "x", "max_tokens": 10, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            lines = [line async for line in r.aiter_lines()]  # a clean close: no httpx error here
        text = (await client.get("/metrics")).text
    events = _events(lines)
    assert [e["choices"][0]["text"] for e in events[:3]] == [" t0", " t1", " t2"]
    assert len(events) == 4
    assert events[3]["error"]["code"] == "upstream_died"
    assert set(events[3]["error"]) == {"message", "type", "param", "code"}
    assert 'decode_proxy:upstream_errors_total{kind="died_mid_stream"} 1.0' in text


async def test_upstream_error_status_is_passed_through(engine: FakeEngine, proxy: Any) -> None:
    engine.fail_status = 500
    async with proxy({}, engine.url) as (_, client):
        r = await client.post("/v1/completions", json={"model": "m", "prompt": "x"})
    assert r.status_code == 500
    assert r.json()["error"]["message"] == "injected failure"


async def test_ready_follows_the_upstream(engine: FakeEngine, proxy: Any) -> None:
    async with proxy({}, engine.url) as (_, client):
        assert (await client.get("/ready")).status_code == 200
        engine.ready = False
        r = await client.get("/ready")
        assert r.status_code == 503 and r.json()["error"]["code"] == "upstream_not_ready"
        assert (await client.get("/health")).status_code == 200


async def test_other_paths_pass_through(engine: FakeEngine, proxy: Any) -> None:
    async with proxy({}, engine.url) as (_, client):
        models = await client.get("/v1/models")
        tok = await client.post("/tokenize", json={"prompt": "a b c"})
    assert models.json()["data"][0]["id"] == "fake-model"
    assert tok.json()["count"] == 3


async def test_the_upstream_client_keeps_no_cookies() -> None:
    async def set_cookie(request: Request) -> Response:
        response = JSONResponse({})
        response.set_cookie("session", "alice")
        return response

    async def show(request: Request) -> Response:
        return JSONResponse({"cookie": request.headers.get("cookie")})

    app = Starlette(routes=[Route("/set", set_cookie), Route("/show", show)])
    async with serve_loopback(app) as url, make_client(max_connections=4) as client:
        assert "session=alice" in (await client.get(url + "/set")).headers["set-cookie"]
        # One user's cookie must not ride along on the next user's request.
        assert (await client.get(url + "/show")).json() == {"cookie": None}


async def test_an_unchanged_body_is_forwarded_byte_for_byte_and_a_rewritten_one_as_json(proxy: Any) -> None:
    seen: list[bytes] = []

    async def completions(request: Request) -> Response:
        seen.append(await request.body())
        return JSONResponse({"usage": {"completion_tokens": 1}})

    upstream = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])
    # Spacing, key order and a non-ASCII character that json.dumps would have escaped.
    original = '{ "prompt" : "h\u00e9",  "model":"m", "max_tokens": 3 }'.encode()
    policy = {"outputLength": {"maxOutputTokens": 8, "defaultMaxTokens": 4}}
    async with serve_loopback(upstream) as url, proxy(policy, url) as (_, client):
        headers = {"content-type": "application/json"}
        untouched = await client.post("/v1/completions", content=original, headers=headers)
        clamped = await client.post("/v1/completions", content=original.replace(b"3", b"30"), headers=headers)
        defaulted = await client.post("/v1/completions", content=b'{"model": "m", "prompt": "x"}', headers=headers)
    assert untouched.status_code == clamped.status_code == defaulted.status_code == 200
    assert seen[0] == original
    assert json.loads(seen[1]) == {"prompt": "h\u00e9", "model": "m", "max_tokens": 8}
    assert json.loads(seen[2]) == {"model": "m", "prompt": "x", "max_tokens": 4}
