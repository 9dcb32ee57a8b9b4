"""What `routing_sim.py` adds to the autoscaler's queueing model: prefix caches, prompts made of blocks,
multi-turn conversations, and the three routing policies.

- `Costs`: the engine step of `autoscale_model.EngineProfile` with the per-prompt prefill replaced by a
  per-token one, so a prefix-cache hit shortens the step that admits the prompt:
  step = base + per_seq x (running + admitted) + per_token x (the admitted prompts' uncached tokens).
- `CachedReplica`: `autoscale_model.Replica` (the proxy's queues, continuous batching, the SLO judgement)
  with the engine's prefix cache, an LRU of prompt blocks bounded by the KV capacity. A prompt's hit is
  its longest run of leading blocks present, counted when the engine admits it, as the engine does.
- `Turn`: a request whose prompt is a chain of block keys (the router's `PromptKeys.blocks`).
- Policies: `RouterPolicy` runs the router's own decision (`router/scoring.py`: `decide`, `should_shed`),
  its prefix index (`router/prefix_index.py`), its per-endpoint TTFT model (`router/prefill_model.py`) and
  its in-flight table (`router/fleet.py`'s `EndpointState`), on the simulation's clock; `RoundRobin` is what
  a Service does; `Affinity` is rendezvous hashing of the conversation alone, blind to load.
"""

from __future__ import annotations

import collections
import itertools
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from autoscale_model import CLASSES, EngineProfile, Objectives, Outcomes, Replica, Request, Trace

from decodeservice.proxy.policy import PriorityClass
from decodeservice.router.dispatch import shed_objective
from decodeservice.router.fleet import EndpointState, InFlight
from decodeservice.router.prefill_model import PrefillModel
from decodeservice.router.prefix_index import PrefixIndex
from decodeservice.router.scoring import EndpointView, decide, rendezvous, should_shed

BLOCK = 16  # tokens a block, the engines' default
SCRAPE_S = 1.0  # the router's --scrape-interval-seconds


@dataclass(frozen=True, kw_only=True)
class Costs:
    base_s: float
    per_seq_s: float
    per_token_s: float  # prefill, per uncached prompt token
    max_num_seqs: int
    kv_capacity_tokens: int


class _StepCost(EngineProfile):
    """The replica's `profile`: `Replica` calls `step(running, admitted)`; the prefill term reads the
    admitted prompts' uncached tokens from the replica (the engine's cache decides them at admission)."""

    _costs: Costs
    _replica: CachedReplica

    def __init__(self, costs: Costs, replica: CachedReplica) -> None:
        super().__init__(base_s=costs.base_s, per_seq_s=costs.per_seq_s, prefill_s=0.0,
                         max_num_seqs=costs.max_num_seqs, kv_capacity_tokens=costs.kv_capacity_tokens)
        object.__setattr__(self, "_costs", costs)
        object.__setattr__(self, "_replica", replica)

    def step(self, running: int, admitted: int) -> float:
        c, replica = self._costs, self._replica
        return c.base_s + c.per_seq_s * (running + admitted) + c.per_token_s * replica.admitted_prefill()


@dataclass(kw_only=True)
class Turn(Request):
    blocks: tuple[int, ...] = ()
    conversation: bytes = b""
    uncached: int = -1  # set when the engine admits it
    on_first_token: Callable[[Turn, float], None] | None = None
    on_done: Callable[[Turn, float], None] | None = None


class CachedReplica(Replica):
    def __init__(self, name: str, *, costs: Costs, created: float, ready_at: float,
                 objectives: dict[str, Objectives], outcomes: Outcomes) -> None:
        # The proxy forwards as many requests as the engine has slots (the product's defaults pair them:
        # maxInflight 64, --max-num-seqs 64), so a full batch shows as the proxy's queue, which the
        # router scrapes.
        super().__init__(name, profile=_StepCost(costs, self), created=created, ready_at=ready_at,
                         objectives=objectives, outcomes=outcomes, proxy_max_inflight=costs.max_num_seqs)
        self.capacity_blocks = costs.kv_capacity_tokens // BLOCK
        self.cache: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.prompt_tokens = self.cached_tokens = 0

    def admitted_prefill(self) -> int:
        total = 0
        for r in self._admitted:
            assert isinstance(r, Turn)
            if r.uncached < 0:
                hit = 0
                for key in r.blocks:
                    if key not in self.cache:
                        break
                    hit += 1
                for key in r.blocks:  # the engine keeps the prompt's full blocks, least recently used out
                    self.cache[key] = None
                    self.cache.move_to_end(key)
                while len(self.cache) > self.capacity_blocks:
                    self.cache.popitem(last=False)
                r.uncached = max(r.prompt_tokens - hit * BLOCK, 1)  # the last token is always computed
                self.prompt_tokens += r.prompt_tokens
                self.cached_tokens += r.prompt_tokens - r.uncached
            total += r.uncached
        return total

    def step_end(self, now: float) -> float | None:
        admitted = list(self._admitted)
        end = super().step_end(now)
        for r in admitted:
            if isinstance(r, Turn) and r.on_first_token is not None:
                r.on_first_token(r, now)
        return end

    def _finish(self, r: Request) -> None:
        super()._finish(r)
        if isinstance(r, Turn) and r.on_done is not None:
            r.on_done(r, self.busy_until or 0.0)


# -- workloads -------------------------------------------------------------------------------------------


def _blocks(app: int, sys_tokens: int, conv: int, tokens: int) -> tuple[int, ...]:
    """Chained block keys: the app's system prompt blocks (shared), then the conversation's own. A block's
    content is fixed by its position in a conversation that only grows, so (conversation, index) names it."""
    n, shared = tokens // BLOCK, sys_tokens // BLOCK
    return tuple(hash(("sys", app, i)) if i < shared else hash(("conv", conv, i)) for i in range(n))


@dataclass(frozen=True, kw_only=True)
class Workload:
    """Arrivals of a trace made into prompts: each request opens with one of `apps` shared system prompts
    (Zipf-popular) of `sys_tokens`; multi-turn conversations then carry a document and grow turn by turn."""

    trace: Trace
    apps: int = 16
    sys_tokens: int = 256
    turns: int = 1  # > 1: each arrival starts a conversation of this many turns
    doc_tokens: tuple[int, int] = (400, 800)
    think_s: float = 10.0  # mean pause between a turn's answer and the next question

    @property
    def name(self) -> str:
        return self.trace.name if self.turns == 1 else f"multi-turn ({self.turns} turns), {self.trace.name}"

    def start(self, seed: int, push: Callable[[Turn], None]) -> None:
        rng = random.Random(seed)
        weights = [1 / (i + 1) for i in range(self.apps)]
        for conv, base in enumerate(self.trace.arrivals(seed)):
            app = rng.choices(range(self.apps), weights)[0]
            doc = rng.randint(*self.doc_tokens) if self.turns > 1 else 0
            self._turn(push, rng, app=app, conv=conv, arrival=base.arrival, cls=base.cls, turn=0,
                       history=self.sys_tokens + doc + base.prompt_tokens, output=base.output_tokens)

    def _turn(self, push: Callable[[Turn], None], rng: random.Random, *, app: int, conv: int, arrival: float,
              cls: str, turn: int, history: int, output: int) -> None:
        def next_turn(done: Turn, at: float) -> None:
            if turn + 1 < self.turns:
                self._turn(push, rng, app=app, conv=conv, arrival=at + rng.expovariate(1 / self.think_s), cls=cls,
                           turn=turn + 1, history=history + output + rng.randint(10, 40), output=rng.randint(16, 128))

        push(Turn(arrival=arrival, cls=cls, prompt_tokens=history, output_tokens=output,
                  blocks=_blocks(app, self.sys_tokens, conv, history),
                  # The router's key: the messages up to the first user turn, so each conversation's own.
                  conversation=f"{app}-{conv}".encode(),
                  on_done=next_turn))


# -- policies --------------------------------------------------------------------------------------------


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._n = itertools.count()

    def pick(self, turn: Turn, ready: Sequence[CachedReplica], now: float) -> CachedReplica | None:
        return ready[next(self._n) % len(ready)]


class Affinity:
    name = "affinity"

    def pick(self, turn: Turn, ready: Sequence[CachedReplica], now: float) -> CachedReplica | None:
        chosen = rendezvous([r.name for r in ready], turn.conversation)
        return next(r for r in ready if r.name == chosen)


class RouterPolicy:
    """The router's decision on the simulation's clock: what `router/fleet.py` and `router/dispatch.py` do
    per request (views with the proxies' queues scraped every second, shed, decide, record, count in
    flight, learn at the first token), minus HTTP. `Fleet.views` reads the wall clock, so its few lines
    are repeated here on the simulation's."""

    name = "router"

    def __init__(self, *, objective_s: float, max_blocks: int) -> None:
        self.objective_s = objective_s
        self.index = PrefixIndex(max_blocks_per_endpoint=max_blocks)
        self.states: dict[str, EndpointState] = {}
        self.scraped: dict[str, tuple[float, dict[str, int]]] = {}  # name -> (when, the proxy's queue by class)
        self.mean_uncached = 256.0
        self.model = PrefillModel()  # the fleet's, as `Fleet.model`
        self.shed = 0
        self._ids = itertools.count()

    def _queued(self, r: CachedReplica, cls: str, now: float) -> int:
        at, queues = self.scraped.get(r.name, (-SCRAPE_S, {}))
        if now - at >= SCRAPE_S:
            queues = r._proxy_queues()
            self.scraped[r.name] = (now, queues)
        # The proxy serves its queue interactive first: a batch request waits behind both classes.
        return queues.get("interactive", 0) + (queues.get("batch", 0) if cls == "batch" else 0)

    def pick(self, turn: Turn, ready: Sequence[CachedReplica], now: float) -> CachedReplica | None:
        views = []
        for r in ready:
            state = self.states.get(r.name)
            if state is None:
                state = self.states[r.name] = EndpointState(url=r.name, probed=False, ready=True,
                                                            model=self.model)
            estimate = state.model.estimate
            queued = self._queued(r, turn.cls, now)
            views.append(EndpointView(
                url=r.name, hit_tokens=self.index.match(r.name, turn.blocks) * BLOCK,
                tokens_ahead=state.prefill_tokens_ahead(now) + queued * self.mean_uncached,
                busy=queued > 0 or bool(state.prefill),
                kv_usage=min(r.kv_tokens / r.profile.kv_capacity_tokens, 1.0),
                # One router sends every request, so its count of streams there is the replica's own.
                streams=r.load, base_s=estimate.base_s,
                cost_per_token_s=estimate.cost_per_token_s, observed=estimate.observed > 0))
        priority = PriorityClass(turn.cls)
        if should_shed(views, prompt_tokens=turn.prompt_tokens,
                       objective_s=shed_objective(priority, self.objective_s)) is not None:
            self.shed += 1
            return None
        d = decide(views, prompt_tokens=turn.prompt_tokens, conversation=turn.conversation,
                   objective_s=self.objective_s)
        state = self.states[d.endpoint]
        uncached = max(1, turn.prompt_tokens - d.hit_tokens)
        self.mean_uncached = 0.9 * self.mean_uncached + 0.1 * uncached  # router/fleet.py's _MEAN_DECAY
        handle = next(self._ids)
        state.prefill[handle] = InFlight(tokens=state.prefill_tokens_ahead(now) + uncached, uncached=uncached,
                                         sent=now, first_token_due=now + d.predicted_ttft_s)
        self.index.record(d.endpoint, turn.blocks)

        def first_token(t: Turn, at: float) -> None:
            request = state.prefill.pop(handle, None)
            if request is not None:
                state.model.observe(tokens=request.tokens, ttft_s=at - request.sent)

        turn.on_first_token = first_token
        return next(r for r in ready if r.name == d.endpoint)

    def forget(self, name: str) -> None:
        self.states.pop(name, None)
        self.index.forget(name)


def shed_miss(outcomes: Outcomes, turn: Turn) -> None:
    """A request the router sheds is a miss of its class's objective, as the proxy's 429 is in the model."""
    assert turn.cls in CLASSES
    outcomes.total[turn.cls] += 1


def percentile_of(values: list[float], p: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    h = (len(values) - 1) * p / 100
    lo = math.floor(h)
    return values[lo] + (values[min(lo + 1, len(values) - 1)] - values[lo]) * (h - lo)
