"""The routing decision, as pure functions of what the router knows (docs/routing.md explains each term).

Per ready endpoint the router predicts the request's time to first token:

    predicted = base + (prefill tokens ahead + the prompt's uncached tokens) x cost per token

`base` and `cost per token` are learned for the whole fleet from the first tokens it observes (`PrefillModel`,
one fit: endpoints of one service differ by the work counted ahead, and per-endpoint bases herded),
"tokens ahead" counts the router's own requests on that endpoint still in prefill plus the proxy's
queue from its /metrics, and the uncached tokens are the prompt minus the prefix the index says the
endpoint holds. Then:

1. one ready endpoint: it (`only_endpoint`);
2. among endpoints predicted within the class's TTFT objective, the largest prefix hit
   (`prefix_hit_within_slo`): a hit is prefill the fleet does not redo. Hits within `HIT_TIE_SHARE`
   of the prompt of the largest count as a tie: a shared system prompt cached on some endpoints only
   must not pull every new conversation there;
3. a tie (a cold prefix, or one only a shared system prompt long): of the tied endpoints predicted
   within `COLD_SLACK` of the objective of the fastest of them, the conversation's first `CHOICES` by
   rendezvous weight, and of those the one with less prefill work ahead, then fewer of the router's
   streams (`rendezvous`). Two
   routers that see the same endpoints choose within the same two without sharing state, so running
   two does not scatter a conversation's turns over every cache, and the streams spread as evenly as
   round-robin's;
4. no endpoint within the objective: the least prefill work, ahead plus the prompt's uncached tokens,
   ties by rendezvous (`least_work`, join-the-shortest-queue: seconds from a fit's base would herd), or a shed
   when even that one is over the objective, busy, and its cost model has been observed, unless the
   request's own prefill is over the objective by itself (`should_shed`).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import math
from collections.abc import Sequence

# A cold prefix may go to any endpoint predicted within this fraction of the objective of the fastest:
# close enough that the hash, not the momentary load, decides (and two routers agree), yet an endpoint
# already a quarter of the objective behind is not handed a full prefill on top.
COLD_SLACK = 0.25
# A cold tie goes to the endpoint with fewer of the router's streams among the conversation's first
# CHOICES by rendezvous weight ("the power of two choices"): the hash alone placed single requests at
# random, so some endpoints batched more decoding streams than others and missed the objectives that
# round-robin's even spread met (benchmarks/routing_sim.py --fixed); two router replicas, each counting
# only its own streams, still pick within the same two endpoints (the same one where their counts
# agree), so a conversation's later turn that reaches the other replica is not scattered over all N.
CHOICES = 2
# Hits that differ by less than this share of the prompt are a tie: what the smaller one costs in extra
# prefill is small beside what piling new conversations onto one endpoint costs in queueing. A
# conversation's own history is most of its later turns' prompts, so those still go to their cache; a
# quarter let a shared system prompt (a third to four fifths of a single request's prompt in
# benchmarks/routing_sim.py) pull requests onto the endpoints that held it, and they queued there.
HIT_TIE_SHARE = 0.5
# Above this KV-cache usage an engine evicts cached prefixes to make room, so a hit the index predicts
# is discounted linearly to nothing at a full cache.
KV_PRESSURE = 0.9


class Reason(enum.StrEnum):
    PREFIX_HIT_WITHIN_SLO = "prefix_hit_within_slo"
    LEAST_PREDICTED_TTFT = "least_predicted_ttft"
    LEAST_WORK = "least_work"
    RENDEZVOUS = "rendezvous"
    ONLY_ENDPOINT = "only_endpoint"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class EndpointView:
    """One ready endpoint as the router sees it for one request of one class."""

    url: str
    hit_tokens: int  # prompt tokens the index expects cached there
    tokens_ahead: float  # prefill tokens that would run before this request's
    busy: bool  # prefill work is ahead of a newcomer there (requests before their first token, or queued)
    kv_usage: float = 0.0  # the engine's KV-cache usage, 0..1 (vllm:kv_cache_usage_perc)
    streams: int = 0  # the router's requests there not yet finished, prefilling or decoding
    base_s: float
    cost_per_token_s: float
    observed: bool  # the cost model has seen a first token from this endpoint


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Decision:
    endpoint: str
    reason: Reason
    predicted_ttft_s: float
    hit_tokens: int  # what the router expects cached on the chosen endpoint (after the KV discount)


def effective_hit(view: EndpointView) -> int:
    if view.kv_usage <= KV_PRESSURE:
        return view.hit_tokens
    return int(view.hit_tokens * max(0.0, (1.0 - view.kv_usage) / (1.0 - KV_PRESSURE)))


def predicted_ttft(view: EndpointView, prompt_tokens: int) -> float:
    uncached = max(prompt_tokens - effective_hit(view), 1)  # the last prompt token is always computed
    return view.base_s + (view.tokens_ahead + uncached) * view.cost_per_token_s


def rendezvous_weight(endpoint: str, key: bytes) -> bytes:
    """Highest random weight hashing: each router computes the same weight, so the same winner."""
    return hashlib.blake2b(key + b"\x00" + endpoint.encode(), digest_size=8).digest()


def rendezvous(endpoints: Sequence[str], key: bytes) -> str:
    return max(endpoints, key=lambda e: rendezvous_weight(e, key))


def decide(views: Sequence[EndpointView], *, prompt_tokens: int, conversation: bytes,
           objective_s: float) -> Decision:
    """Pick an endpoint for a request (see the module docstring); `views` must not be empty."""
    assert views, "decide() needs at least one ready endpoint"
    predicted = {v.url: predicted_ttft(v, prompt_tokens) for v in views}

    def made(view: EndpointView, reason: Reason) -> Decision:
        return Decision(endpoint=view.url, reason=reason, predicted_ttft_s=predicted[view.url],
                        hit_tokens=effective_hit(view))

    if len(views) == 1:
        return made(views[0], Reason.ONLY_ENDPOINT)
    within = [v for v in views if predicted[v.url] <= objective_s]
    if not within:
        return made(least_work(views, prompt_tokens, conversation), Reason.LEAST_WORK)
    best_hit = max(effective_hit(v) for v in within)
    top = [v for v in within if effective_hit(v) >= best_hit - HIT_TIE_SHARE * prompt_tokens]
    if len(top) == 1:
        return made(top[0], Reason.PREFIX_HIT_WITHIN_SLO if best_hit > 0 else Reason.LEAST_PREDICTED_TTFT)
    fastest = min(predicted[v.url] for v in top)
    near = [v for v in top if predicted[v.url] <= fastest + COLD_SLACK * objective_s]
    ranked = sorted(near, key=lambda v: rendezvous_weight(v.url, conversation), reverse=True)[:CHOICES]
    # Prefill ahead delays this request's first token; decoding streams only slow its steps.
    return made(min(ranked, key=lambda v: (v.tokens_ahead, v.streams)), Reason.RENDEZVOUS)


def least_work(views: Sequence[EndpointView], prompt_tokens: int, conversation: bytes) -> EndpointView:
    """Join the shortest queue, counted in prefill tokens (those ahead plus the prompt's uncached ones, so
    a prefix hit shortens an endpoint's queue by what it saves), not in predicted seconds: each endpoint's
    learned base and slope differ by noise, and under load a base learns the wait for a batch slot, so
    the lowest fitted base would draw every request (a herd). Equal work: rendezvous of the conversation,
    so ties spread, and two routers agree, rather than falling to the first URL."""
    work = {v.url: v.tokens_ahead + max(prompt_tokens - effective_hit(v), 1) for v in views}
    least = min(work.values())
    tied = [v.url for v in views if work[v.url] <= least]
    chosen = rendezvous(tied, conversation)
    return next(v for v in views if v.url == chosen)


def should_shed(views: Sequence[EndpointView], *, prompt_tokens: int, objective_s: float) -> float | None:
    """Seconds the best endpoint is predicted to take when every endpoint is predicted over the
    objective, and shedding is warranted; None otherwise.

    As the proxy's admission: a request some endpoint would start at once (no prefill ahead of it: the
    engine batches it in with the streams already decoding) is never shed, since refusing it could make
    no one faster; nor is one whose prediction rests only on the prior (nothing observed yet). Nor is
    one whose own prefill is predicted past the objective on every endpoint (a long cold prompt on a
    slow replica): no retry can meet the objective, so a refusal only adds the client's wait to its TTFT,
    and under steady load it would be refused on every retry while any prefill runs anywhere.
    """
    best = min(predicted_ttft(v, prompt_tokens) for v in views)
    if best <= objective_s:
        return None
    if any(not v.busy or not v.observed for v in views):
        return None
    if min(own_prefill_s(v, prompt_tokens) for v in views) > objective_s:
        return None
    return best


def own_prefill_s(view: EndpointView, prompt_tokens: int) -> float:
    """What the request's own uncached prompt is predicted to take on the endpoint, nothing ahead of it
    (without the base, which is mostly a step's fixed cost and says nothing about this prompt)."""
    return max(prompt_tokens - effective_hit(view), 1) * view.cost_per_token_s


def retry_after_seconds(predicted_s: float, objective_s: float) -> int:
    """When to come back: once the backlog ahead has drained by what the prediction exceeds the
    objective by (at least a second, the header's unit)."""
    return max(1, math.ceil(predicted_s - objective_s))
