"""The fleet's bookkeeping: work ahead on an endpoint, readiness, and what removal forgets."""

from __future__ import annotations

import time

import pytest

from decodeservice.proxy.policy import PriorityClass
from decodeservice.router.fleet import Fleet
from decodeservice.router.prefix_index import PrefixIndex
from decodeservice.router.prompt_keys import prompt_keys

KEYS = prompt_keys({"prompt": list(range(64))}, block_size=16, salt=None)


def fleet() -> Fleet:
    f = Fleet(index=PrefixIndex(max_blocks_per_endpoint=100), scrape_interval_s=1.0)
    f.update({"http://a": True, "http://b": True})
    return f


def test_work_ahead_is_what_is_left_until_the_last_predicted_first_token() -> None:
    f = fleet()
    (a, b) = f.views(PriorityClass.INTERACTIVE, KEYS)
    assert a.tokens_ahead == b.tokens_ahead == 0 and not a.busy
    first = f.dispatched("http://a", uncached=500, predicted_ttft_s=0.52)
    f.dispatched("http://a", uncached=100, predicted_ttft_s=0.62)
    a, b = f.views(PriorityClass.INTERACTIVE, KEYS)
    assert a.tokens_ahead == pytest.approx(600, abs=5) and a.busy  # both prompts, nothing done yet
    later = f.endpoints["http://a"].prefill_tokens_ahead(time.perf_counter() + 0.26)
    assert later == pytest.approx(500 / 2 + 100 * 0.36 / 0.62, abs=10)  # each one done in proportion
    assert b.tokens_ahead == 0
    f.first_token("http://a", first, ttft_s=0.5)
    f.finished("http://a", first)
    assert f.endpoints["http://a"].model.observed == 1


def test_unready_and_removed_endpoints_are_not_routed_to() -> None:
    f = fleet()
    f.index.record("http://a", KEYS.blocks)
    f.mark_unready("http://a")
    assert [v.url for v in f.views(PriorityClass.INTERACTIVE, KEYS)] == ["http://b"]
    f.update({"http://b": True})  # a's pod is gone: its index goes with it
    assert f.index.size("http://a") == 0 and list(f.endpoints) == ["http://b"]
    f.update({"http://b": True, "http://a": None})  # back, probed by us, unready until probed
    assert f.ready_urls() == ["http://b"]


def test_every_endpoint_shares_the_fleets_ttft_model() -> None:
    # One service: one model on one hardware. Per endpoint, a base fitted on a few waits drew the requests
    # to whichever endpoint's was lowest (a herd); pooled, endpoints differ only by the work counted ahead.
    f = fleet()
    for i in range(50):
        url = "http://a" if i % 2 else "http://b"
        handle = f.dispatched(url, uncached=200 + 20 * i, predicted_ttft_s=0.1)
        f.first_token(url, handle, ttft_s=0.05 + 0.001 * (200 + 20 * i))
        f.finished(url, handle)
    f.update({"http://a": True, "http://b": True, "http://c": True})
    estimates = {url: e.model.estimate for url, e in f.endpoints.items()}
    assert {e.observed for e in estimates.values()} == {50}  # a new endpoint starts from what the fleet learned
    assert estimates["http://c"] == estimates["http://a"] == estimates["http://b"]
    assert estimates["http://c"].cost_per_token_s == pytest.approx(0.001, rel=0.1)


def test_streams_count_a_request_until_it_finishes_not_until_its_first_token() -> None:
    # A decoding stream delays no newcomer's prefill, but it holds a batch slot and slows every step: a
    # cold tie is balanced by how many streams each endpoint has, so they stay counted past the first token.
    f = fleet()
    one = f.dispatched("http://a", uncached=100, predicted_ttft_s=0.1)
    two = f.dispatched("http://a", uncached=100, predicted_ttft_s=0.1)
    f.first_token("http://a", one, ttft_s=0.1)
    a, b = f.views(PriorityClass.INTERACTIVE, KEYS)
    assert (a.streams, b.streams) == (2, 0)
    f.finished("http://a", one)
    f.finished("http://a", one)  # a second report of the same request changes nothing
    f.finished("http://a", two)
    assert [v.streams for v in f.views(PriorityClass.INTERACTIVE, KEYS)] == [0, 0]
