"""Faults against the real engine (bundled model, in-process uvicorn) and the real proxy, on loopback.

For each fault: what the clients saw (a full answer or a clean OpenAI-JSON error, never a hang), that
the engine's running/waiting gauges and free blocks return to idle, and that the proxy's and the
engine's counters agree with the clients. Killing the engine process is in test_engine_killed.py.
"""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Callable
from typing import Any

import pytest

from tests.conftest import ModelBundle
from tests.engine.test_server_harness import RunningServer, running_server
from tests.proxy.conftest import running_proxy
from tests.reliability.conftest import assert_engine_idle, stack, wait_for
from tests.reliability.outcomes import Outcome, Seen, Tally, classify_events, request, scrape, total
from tests.support.fake_engine import FakeEngine, serve_loopback

Record = Callable[[Tally], dict[str, Any]]
COMPLETION = {"prompt": "Once upon a time", "temperature": 0}
CHAT = {"messages": [{"role": "user", "content": "Say something."}], "temperature": 0}


def _body(i: int, *, max_tokens: int = 8) -> tuple[str, dict[str, Any]]:
    chat = i % 2 == 1
    body = {**(CHAT if chat else COMPLETION), "max_tokens": max_tokens, "stream": i % 3 != 0, "ignore_eos": True}
    if body["stream"] and i % 4 == 0:
        body["stream_options"] = {"include_usage": True}
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


async def test_mixed_traffic_with_disconnects_loses_nothing_and_counters_agree(
        engine_srv: RunningServer, record: Record) -> None:
    async with stack(engine_srv) as s:
        proxy_before, engine_before = scrape(await s.proxy_metrics()), engine_srv.metrics()
        jobs = []
        for i in range(16):
            path, body = _body(i)
            leave = 2 if body["stream"] and i % 5 == 1 else None  # some clients go away mid-stream
            jobs.append(request(s.client, path, body, stop_after_chunks=leave))
        tally = Tally("mixed_traffic_with_disconnects")
        tally.add(*await asyncio.gather(*jobs))
        await assert_engine_idle(engine_srv)
        summary = record(tally)
        assert summary["lost"] == 0
        full = summary["outcomes"].get("full", 0)
        left = summary["outcomes"].get("disconnected", 0)
        assert full + left == 16 and left >= 2

        proxy_after, engine_after = scrape(await s.proxy_metrics()), engine_srv.metrics()

        def delta(after: dict[Any, float], before: dict[Any, float], name: str, **labels: str) -> float:
            return total(after, name, **labels) - total(before, name, **labels)

        # The proxy answered every request it was sent; the engine finished (at their length) exactly the
        # ones the proxy answered 200 and aborted the ones it counted 499. A client that leaves after the
        # last token was relayed is a 200 on both sides, so the clients agree up to those.
        answered_200 = delta(proxy_after, proxy_before, "decode_proxy:requests_total", status="200")
        answered_499 = delta(proxy_after, proxy_before, "decode_proxy:requests_total", status="499")
        assert delta(proxy_after, proxy_before, "decode_proxy:requests_total") == answered_200 + answered_499 == 16
        assert delta(engine_after, engine_before, "vllm:request_success_total", finished_reason="length") \
            == answered_200
        assert delta(engine_after, engine_before, "vllm:request_success_total", finished_reason="abort") \
            == answered_499
        assert full <= answered_200 <= full + left


async def test_kv_cache_exhaustion_preempts_and_everyone_finishes(bundled: ModelBundle, record: Record) -> None:
    # 16 blocks of 16 tokens; 6 streams of ~5 prompt + 60 output tokens need 5 blocks each: 30 > 16.
    config = {"num_gpu_blocks_override": 16, "max_model_len": 256, "max_num_seqs": 8}
    with running_server(lambda: bundled.engine(**config)) as srv:
        async with stack(srv) as s:
            body = {**COMPLETION, "max_tokens": 60, "ignore_eos": True, "stream": True}
            tally = Tally("kv_cache_exhaustion")
            tally.add(*await asyncio.gather(*(request(s.client, "/v1/completions", body, deadline_s=240)
                                              for _ in range(6))))
            await assert_engine_idle(srv)
            summary = record(tally)
            assert summary["outcomes"] == {"full": 6}
            assert srv.aengine.stats().num_preemptions > 0  # it was exhausted, and recovered


async def test_upstream_5xx_and_death_mid_stream_are_clean_errors(record: Record) -> None:
    fake = FakeEngine(default_tokens=6)
    async with serve_loopback(fake.app()) as url, running_proxy({}, url) as (_, client):
        tally = Tally("upstream_5xx_and_mid_stream_death")
        for status in (500, 502, 503):
            fake.fail_status = status
            for stream in (False, True):
                seen = await request(client, "/v1/completions", {"prompt": "x", "max_tokens": 4, "stream": stream})
                tally.add(seen)
                assert seen.outcome is Outcome.CLEAN_ERROR and seen.status == status
        fake.fail_status, fake.die_after_tokens = None, 2
        for path in ("/v1/completions", "/v1/chat/completions"):
            seen = await request(client, path, {"prompt": "x", "messages": [], "max_tokens": 6, "stream": True})
            tally.add(seen)
            assert seen.outcome is Outcome.CLEAN_ERROR and seen.error_code == "upstream_died"
        assert record(tally)["lost"] == 0


async def test_a_first_token_that_never_comes_is_ended_by_the_proxy(record: Record) -> None:
    """The proxy's `slo.firstTokenTimeoutMs` (short here) ends the wait: each stream gets a terminal SSE
    `first_token_timeout` error (a chat stream's role-only chunk is not a token), the upstream streams are
    cancelled, other requests are served meanwhile, and the proxy's in-flight count returns to zero.
    (No response head at all is a 504: tests/proxy/test_upstream_timeouts.py.)"""
    stalled, healthy = FakeEngine(ttft_s=3600), FakeEngine()
    policy = {"slo": {"firstTokenTimeoutMs": 300}}
    async with serve_loopback(stalled.app()) as stalled_url, serve_loopback(healthy.app()) as healthy_url, \
            running_proxy(policy, stalled_url) as (app, client), running_proxy(policy, healthy_url) as (_, other):
        tally = Tally("first_token_never_comes")
        bodies = [("/v1/completions" if i % 2 else "/v1/chat/completions",
                   {"prompt": "x", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "stream": True})
                  for i in range(4)]
        waiting = [asyncio.create_task(request(client, path, body, deadline_s=30)) for path, body in bodies]
        served = await request(other, "/v1/completions", bodies[1][1])
        assert served.outcome is Outcome.FULL
        results = await asyncio.gather(*waiting)
        assert all(r.outcome is Outcome.CLEAN_ERROR and r.status == 200 and r.error_code == "first_token_timeout"
                   and "slo.firstTokenTimeoutMs (300 ms)" in r.detail for r in results), results
        tally.add(*results, served)
        await stalled.wait_for(lambda f: f.started == 4 and f.cancelled == 4 and f.active == 0)
        await wait_for(lambda: app.state.lifecycle.inflight == 0, timeout=5, what="the proxy to forget them")
        assert total(scrape((await client.get("/metrics")).text), "decode_proxy:upstream_errors_total",
                     kind="first_token_timeout") == 4
        assert record(tally)["lost"] == 0


async def test_sigterm_drains_streams_in_flight(bundled: ModelBundle, record: Record) -> None:
    with running_server(lambda: bundled.engine(max_model_len=512, kv_cache_gib=0.05)) as srv:
        async with stack(srv) as s:
            body = {**COMPLETION, "max_tokens": 24, "ignore_eos": True, "stream": True}
            streams = [asyncio.create_task(request(s.client, "/v1/completions", body)) for _ in range(3)]
            await wait_for(lambda: srv.aengine.stats().num_running == 3 and srv.aengine.stats().generation_tokens > 3,
                           timeout=60, what="three streams generating")
            srv.server.handle_exit(signal.SIGTERM, None)  # what uvicorn calls on SIGTERM
            refused = await request(s.client, "/v1/completions", {**COMPLETION, "max_tokens": 2})
            tally = Tally("sigterm_drain_with_streams_in_flight")
            tally.add(*await asyncio.gather(*streams), refused)
            summary = record(tally)
            assert summary["outcomes"] == {"full": 3, "clean_error": 1}
            assert refused.status == 503 and refused.error_code == "draining"
            await wait_for(lambda: srv.server.should_exit, timeout=30, what="the server to stop after draining")
            await assert_engine_idle(srv)


async def _raw_stream(port: int, body: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    await writer.drain()
    return reader, writer


async def test_slow_and_stalled_readers(engine_srv: RunningServer, record: Record) -> None:
    """A client that reads a few bytes at a time still gets its whole answer; one that never reads and
    then leaves frees everything. (Answers this short fit in the socket buffers, so the engine never
    waits on a stalled reader; the engine decouples generation from sending in any case.)"""
    async with stack(engine_srv) as s:
        port = int(str(s.client.base_url).rsplit(":", 1)[1].rstrip("/"))
        body = json.dumps({**COMPLETION, "max_tokens": 16, "ignore_eos": True, "stream": True}).encode()
        tally = Tally("slow_and_stalled_readers")
        reader, writer = await _raw_stream(port, body)
        data = bytearray()
        while not data.endswith(b"0\r\n\r\n"):  # the chunked body's end
            piece = await asyncio.wait_for(reader.read(7), 60)
            if not piece:
                break
            data += piece
            await asyncio.sleep(0.002)  # the injected fault: a reader this slow
        writer.close()
        events = [line[6:].decode() for line in bytes(data).split(b"\n") if line.startswith(b"data: ")]
        tally.add(classify_events(200, events))

        before = engine_srv.aengine.stats().generation_tokens
        stalled = [await _raw_stream(port, body) for _ in range(4)]  # they never read a byte
        await wait_for(lambda: engine_srv.aengine.stats().generation_tokens >= before + 8, timeout=60,
                       what="the stalled streams to generate")
        for _, w in stalled:
            w.close()
        tally.add(*(Seen(Outcome.DISCONNECTED, 0) for _ in stalled))
        await assert_engine_idle(engine_srv)
        await wait_for(lambda: s.proxy.state.lifecycle.inflight == 0, timeout=30, what="the proxy to let them go")
        assert record(tally)["lost"] == 0


@pytest.mark.parametrize("target", ["proxy", "engine"])
async def test_a_flood_of_connections_that_never_send_a_body(engine_srv: RunningServer, record: Record,
                                                              target: str) -> None:
    async with stack(engine_srv) as s:
        url = str(s.client.base_url) if target == "proxy" else engine_srv.url
        port = int(url.rstrip("/").rsplit(":", 1)[1])
        flood = []
        for _ in range(64):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{\"prompt\": ")  # and then nothing, ever
            flood.append(writer)
        for w in flood:
            await w.drain()
        if target == "proxy":
            await wait_for(lambda: s.proxy.state.lifecycle.inflight == 64, timeout=30, what="the flood to arrive")
        tally = Tally(f"flood_without_body_{target}")
        # Everyone else is still served while the flood holds its connections open.
        tally.add(*await asyncio.gather(*(request(s.client, "/v1/completions", {**COMPLETION, "max_tokens": 4})
                                          for _ in range(4))))
        for w in flood:
            w.close()
        tally.add(*(Seen(Outcome.DISCONNECTED, 0) for _ in flood))
        await wait_for(lambda: s.proxy.state.lifecycle.inflight == 0, timeout=30, what="the proxy to drop the flood")
        await assert_engine_idle(engine_srv)
        summary = record(tally)
        assert summary["lost"] == 0 and summary["outcomes"]["full"] == 4
