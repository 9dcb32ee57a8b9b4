"""The routing decision as pure functions (router/scoring.py), and the TTFT model it rests on."""

from __future__ import annotations

import dataclasses

import pytest

from decodeservice.router.prefill_model import PrefillModel
from decodeservice.router.scoring import (
    EndpointView,
    Reason,
    decide,
    predicted_ttft,
    rendezvous,
    rendezvous_weight,
    retry_after_seconds,
    should_shed,
)

COST = 0.001  # s per token
BASE = 0.02


def view(url: str, *, hit: int = 0, ahead: float = 0.0, busy: bool = False, kv: float = 0.0,
         observed: bool = True, streams: int = 0) -> EndpointView:
    return EndpointView(url=url, hit_tokens=hit, tokens_ahead=ahead, busy=busy, kv_usage=kv, base_s=BASE,
                        cost_per_token_s=COST, observed=observed, streams=streams)


def test_predicted_ttft_is_base_plus_work_ahead_and_uncached_prompt() -> None:
    assert predicted_ttft(view("a", hit=400, ahead=100), 600) == pytest.approx(BASE + (100 + 200) * COST)
    # The last prompt token is computed even on a full hit.
    assert predicted_ttft(view("a", hit=600), 600) == pytest.approx(BASE + COST)


def test_a_full_kv_cache_discounts_the_predicted_hit() -> None:
    assert predicted_ttft(view("a", hit=400, kv=0.95), 600) == pytest.approx(BASE + 400 * COST)
    assert predicted_ttft(view("a", hit=400, kv=1.0), 600) == pytest.approx(BASE + 600 * COST)


def test_one_endpoint_is_chosen_as_the_only_one() -> None:
    d = decide([view("a", ahead=1e6)], prompt_tokens=10, conversation=b"c", objective_s=1.0)
    assert (d.endpoint, d.reason) == ("a", Reason.ONLY_ENDPOINT)


def test_the_largest_prefix_hit_within_the_objective_wins_even_if_busier() -> None:
    views = [view("a", hit=0), view("b", hit=512, ahead=300)]  # b: 0.02 + 0.3 + 0.088 < 1 s
    d = decide(views, prompt_tokens=600, conversation=b"c", objective_s=1.0)
    assert (d.endpoint, d.reason, d.hit_tokens) == ("b", Reason.PREFIX_HIT_WITHIN_SLO, 512)
    assert d.predicted_ttft_s == pytest.approx(BASE + (300 + 88) * COST)


def test_a_hit_on_an_endpoint_predicted_past_the_objective_is_passed_over() -> None:
    views = [view("a", hit=0), view("b", hit=512, ahead=2000)]
    d = decide(views, prompt_tokens=600, conversation=b"c", objective_s=1.0)
    assert (d.endpoint, d.reason) == ("a", Reason.LEAST_PREDICTED_TTFT)


def test_when_no_endpoint_meets_the_objective_the_least_work_wins() -> None:
    views = [view("a", ahead=3000), view("b", hit=512, ahead=2500), view("c", ahead=2900)]
    d = decide(views, prompt_tokens=600, conversation=b"c", objective_s=1.0)
    assert (d.endpoint, d.reason) == ("b", Reason.LEAST_WORK)
    assert d.predicted_ttft_s == pytest.approx(BASE + (2500 + 88) * COST)


def test_over_the_objective_a_low_learned_base_does_not_draw_requests() -> None:
    # Under load each base learns the wait for a batch slot with a slope near 0: b's lower base must not
    # win over a's shorter queue, or every request would go to b.
    views = [dataclasses.replace(view("a", ahead=200), base_s=1.2, cost_per_token_s=1e-7),
             dataclasses.replace(view("b", ahead=900), base_s=1.1, cost_per_token_s=1e-7)]
    d = decide(views, prompt_tokens=600, conversation=b"c", objective_s=1.0)
    assert (d.endpoint, d.reason) == ("a", Reason.LEAST_WORK)
    # The same work everywhere: the conversation's hash spreads requests instead of the first URL taking all.
    same = [dataclasses.replace(view(u), base_s=1.2, cost_per_token_s=1e-7) for u in "abcd"]
    chosen = [decide(same, prompt_tokens=600, conversation=bytes([k]), objective_s=1.0) for k in range(64)]
    assert {c.endpoint for c in chosen} == set("abcd") and {c.reason for c in chosen} == {Reason.LEAST_WORK}
    assert all(c.endpoint == rendezvous(list("abcd"), bytes([k])) for k, c in enumerate(chosen))


def test_a_cold_prefix_goes_by_rendezvous_among_the_near_least_loaded() -> None:
    views = [view("a", ahead=100), view("b", ahead=100), view("c", ahead=900)]  # c is 0.8 s behind: not near
    chosen = {decide(views, prompt_tokens=600, conversation=bytes([k]), objective_s=2.0).endpoint
              for k in range(64)}
    assert chosen == {"a", "b"}  # both near ones get conversations, the far one none
    d = decide(views, prompt_tokens=600, conversation=b"x", objective_s=2.0)
    assert d.reason is Reason.RENDEZVOUS
    assert d.endpoint == rendezvous(["a", "b"], b"x")


def test_a_cold_tie_goes_to_the_fewer_streams_of_its_two_rendezvous_choices() -> None:
    # Streams past their first token add no prefill ahead, so the prediction cannot tell these apart;
    # the hash alone sent conversations to the endpoint already decoding more (placement at random).
    key = b"conv-7"
    first, second, third = sorted("abc", key=lambda url: rendezvous_weight(url, key), reverse=True)
    views = [view(first, streams=5), view(second, streams=2), view(third)]
    d = decide(views, prompt_tokens=600, conversation=key, objective_s=2.0)
    # The fewer streams of the conversation's two choices, not the least loaded of all: another router
    # replica, counting only its own streams, still picks within the same two.
    assert (d.endpoint, d.reason) == (second, Reason.RENDEZVOUS)
    even = [view(u, streams=3) for u in "abc"]
    assert decide(even, prompt_tokens=600, conversation=key, objective_s=2.0).endpoint == first


def test_a_prefix_every_endpoint_holds_is_a_tie_broken_by_rendezvous() -> None:
    views = [view("a", hit=64), view("b", hit=64)]  # a shared system prompt, cached everywhere
    d = decide(views, prompt_tokens=600, conversation=b"conv-1", objective_s=1.0)
    assert d.reason is Reason.RENDEZVOUS
    assert d.endpoint == rendezvous(["a", "b"], b"conv-1")


def test_a_small_hit_such_as_a_shared_system_prompt_is_a_tie() -> None:
    views = [view("a", hit=96), view("b")]  # only a has served the 96-token system prompt yet
    chosen = {decide(views, prompt_tokens=700, conversation=bytes([k]), objective_s=1.0).endpoint
              for k in range(32)}
    assert chosen == {"a", "b"}
    d = decide([view("a", hit=640), view("b")], prompt_tokens=700, conversation=b"c", objective_s=1.0)
    assert (d.endpoint, d.reason) == ("a", Reason.PREFIX_HIT_WITHIN_SLO)


def test_a_system_prompt_under_half_the_prompt_does_not_pull_requests_to_where_it_is_cached() -> None:
    # 256 of 600 tokens: a quarter of the prompt counted as a hit worth piling onto one endpoint for.
    views = [view("a", hit=256), view("b"), view("c")]
    chosen = {decide(views, prompt_tokens=600, conversation=bytes([k]), objective_s=2.0).endpoint
              for k in range(48)}
    assert chosen == {"a", "b", "c"}


def test_a_cold_tie_prefers_the_choice_with_less_prefill_ahead_over_fewer_streams() -> None:
    key = b"conv-9"
    first, second = sorted("ab", key=lambda url: rendezvous_weight(url, key), reverse=True)
    # The first choice decodes fewer streams but has a prompt in prefill, which delays a newcomer's first
    # token; the second's streams only slow its steps.
    views = [view(first, ahead=100, streams=1), view(second, streams=4)]
    d = decide(views, prompt_tokens=600, conversation=key, objective_s=2.0)
    assert (d.endpoint, d.reason) == (second, Reason.RENDEZVOUS)


def test_rendezvous_moves_only_the_keys_of_a_removed_endpoint() -> None:
    keys = [f"conv-{i}".encode() for i in range(200)]
    before = {k: rendezvous(["a", "b", "c"], k) for k in keys}
    after = {k: rendezvous(["a", "b"], k) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == "c" for k in moved)
    assert 40 < sum(1 for k in keys if before[k] == "c") < 100  # about a third each


def test_shedding_needs_every_endpoint_busy_observed_and_over_the_objective() -> None:
    over = [view("a", ahead=2000, busy=True), view("b", ahead=3000, busy=True)]
    assert should_shed(over, prompt_tokens=600, objective_s=1.0) == pytest.approx(BASE + 2600 * COST)
    assert should_shed([*over[:1], dataclasses.replace(over[1], busy=False)], prompt_tokens=600,
                       objective_s=1.0) is None
    assert should_shed([dataclasses.replace(v, observed=False) for v in over], prompt_tokens=600,
                       objective_s=1.0) is None
    assert should_shed(over, prompt_tokens=600, objective_s=5.0) is None
    assert retry_after_seconds(3.62, 1.0) == 3 and retry_after_seconds(1.01, 1.0) == 1


def test_the_prefill_model_learns_base_and_cost_from_observations() -> None:
    model = PrefillModel()
    assert model.estimate.observed == 0
    for i in range(60):
        tokens = 100 + (i % 6) * 200
        model.observe(tokens=tokens, ttft_s=0.05 + tokens * 0.0004)
    estimate = model.estimate
    assert estimate.observed == 60
    assert estimate.cost_per_token_s == pytest.approx(0.0004, rel=0.05)
    assert estimate.base_s == pytest.approx(0.05, rel=0.2)


def test_the_prefill_model_keeps_its_slope_when_every_sample_is_one_size() -> None:
    model = PrefillModel(base_s=0.0, cost_per_token_s=0.001)
    for _ in range(200):
        model.observe(tokens=500, ttft_s=1.0)
    estimate = model.estimate
    assert estimate.base_s + 500 * estimate.cost_per_token_s == pytest.approx(1.0, rel=0.05)
    assert estimate.cost_per_token_s > 0


def test_a_prompt_too_long_to_meet_the_objective_alone_is_queued_not_shed() -> None:
    # 1500 uncached tokens take 1.5 s to prefill: past a 1 s objective whatever the load, so a refusal
    # could only add the client's wait; the same prompt two thirds cached would meet it alone.
    over = [view("a", ahead=2000, busy=True), view("b", ahead=2000, busy=True)]
    assert should_shed(over, prompt_tokens=1500, objective_s=1.0) is None
    half = [dataclasses.replace(v, hit_tokens=1000) for v in over]
    assert should_shed(half, prompt_tokens=1500, objective_s=1.0) == pytest.approx(BASE + 2500 * COST)
