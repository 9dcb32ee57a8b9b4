"""The endpoints the router knows, their readiness and load, and the requests it has on each.

Endpoints come from a source (router/endpoints.py) as `url -> ready` where `ready` is the
EndpointSlice's condition, or None for a static list, whose readiness the router probes itself
(each proxy's `GET /ready`). Every `scrape_interval_s` (every `FAST_PROBE_S` while no endpoint is
ready, so a held request is answered soon after a pod comes up) each known endpoint is probed and its
/metrics read. A request that cannot connect marks its endpoint unready until the next probe says
otherwise. Held requests wait on `wait_for_ready`, a condition woken whenever the ready set changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time

import httpx

from decodeservice.proxy.policy import PriorityClass
from decodeservice.router.prefill_model import PrefillModel
from decodeservice.router.prefix_index import PrefixIndex
from decodeservice.router.prompt_keys import PromptKeys
from decodeservice.router.scoring import EndpointView
from decodeservice.router.scrape import NO_LOAD, ScrapedLoad, probe_ready, scrape_load

log = logging.getLogger(__name__)
FAST_PROBE_S = 0.1
_MEAN_DECAY = 0.9


@dataclasses.dataclass(kw_only=True, slots=True)
class InFlight:
    """One of the router's requests on an endpoint, until its first token."""

    tokens: float  # prefill tokens ahead of it at dispatch plus its own uncached ones (the model's x)
    uncached: int  # its own prompt tokens to prefill
    sent: float  # time.perf_counter() at dispatch
    first_token_due: float  # when its first token is predicted

    def remaining(self, now: float) -> float:
        """Its prefill not yet done, taken as progressing evenly until its predicted first token."""
        span = self.first_token_due - self.sent
        if span <= 0:
            return 0.0
        return self.uncached * min(1.0, max(0.0, (self.first_token_due - now) / span))


@dataclasses.dataclass(kw_only=True, slots=True)
class EndpointState:
    url: str
    probed: bool  # readiness comes from our own /ready probe (static list), not from an EndpointSlice
    ready: bool = False
    load: ScrapedLoad = NO_LOAD
    model: PrefillModel = dataclasses.field(default_factory=PrefillModel)  # the Fleet passes its one model
    # The router's requests there still before their first token; a stream that has begun decoding no
    # longer delays a newcomer (the engine batches it in), so it leaves this table.
    prefill: dict[int, InFlight] = dataclasses.field(default_factory=dict)
    # Every request of the router's there until it finishes, prefilling or decoding: what a cold tie is
    # balanced by (decoding streams set the ITL and a batch's slots, though they delay no newcomer's start).
    streams: set[int] = dataclasses.field(default_factory=set)

    def prefill_tokens_ahead(self, now: float) -> float:
        """The prefill still ahead of a newcomer, in tokens: what is left of each earlier request's
        uncached prompt (counting each one whole would count again the part already done). Only tokens:
        the per-request base of the model is mostly a step's fixed cost, which a batch shares, so
        adding it up per request ahead would serialise what the engine runs together."""
        return sum(r.remaining(now) for r in self.prefill.values())


class Fleet:
    def __init__(self, *, index: PrefixIndex, scrape_interval_s: float) -> None:
        self.index = index
        self.scrape_interval_s = scrape_interval_s
        self.endpoints: dict[str, EndpointState] = {}
        self._changed = asyncio.Condition()
        self._ids = itertools.count()
        # The mean uncached prompt of a request: what each request in a proxy's queue is taken to cost.
        self.mean_uncached = 256.0
        # One TTFT model for the fleet, fed by every endpoint's first tokens: the endpoints of one service
        # run the same model on the same hardware, so what differs between them is the work counted ahead.
        # Fitted per endpoint, each base learned that endpoint's recent uncounted waits (a batch slot, the
        # prefill of prompts admitted in the same step), and the lowest fitted base drew the requests until
        # it was overloaded: a herd (benchmarks/routing_sim.py, docs/routing.md).
        self.model = PrefillModel()

    # -- the endpoint set ---------------------------------------------------------------------------
    def ready_urls(self) -> list[str]:
        return [url for url, e in self.endpoints.items() if e.ready]

    def update(self, endpoints: dict[str, bool | None]) -> None:
        """The source's current set: `url -> ready` (None: probe it ourselves)."""
        for url in list(self.endpoints):
            if url not in endpoints:
                del self.endpoints[url]
                self.index.forget(url)
        for url, ready in endpoints.items():
            state = self.endpoints.get(url)
            if state is None:
                state = self.endpoints[url] = EndpointState(url=url, probed=ready is None, model=self.model)
            if ready is not None:
                state.ready = ready
        self._notify()

    def mark_unready(self, url: str) -> None:
        state = self.endpoints.get(url)
        if state is not None and state.ready:
            state.ready = False
            self._notify()

    def _notify(self) -> None:
        async def wake() -> None:
            async with self._changed:
                self._changed.notify_all()

        with contextlib.suppress(RuntimeError):  # no running loop (a unit test building the fleet)
            asyncio.get_running_loop().create_task(wake())

    async def wait_for_ready(self, timeout: float) -> bool:
        """True as soon as some endpoint is ready; False when `timeout` passes first."""
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: bool(self.ready_urls())), timeout)
            except TimeoutError:
                return bool(self.ready_urls())
        return True

    # -- what a decision reads ------------------------------------------------------------------------
    def views(self, priority: PriorityClass, keys: PromptKeys, *, exclude: frozenset[str] = frozenset(),
              ) -> list[EndpointView]:
        now = time.perf_counter()
        views = []
        for url, e in self.endpoints.items():
            if not e.ready or url in exclude:
                continue
            # The proxy serves its queue interactive first: a batch request waits behind both classes.
            queued = e.load.waiting[PriorityClass.INTERACTIVE]
            if priority is PriorityClass.BATCH:
                queued += e.load.waiting[PriorityClass.BATCH]
            estimate = e.model.estimate
            ahead = e.prefill_tokens_ahead(now) + queued * self.mean_uncached
            views.append(EndpointView(
                url=url, hit_tokens=self.index.match(url, keys.blocks) * keys.block_tokens, tokens_ahead=ahead,
                # Streams past their first token do not delay a newcomer's start: the engine batches it
                # in at once. Only prefill ahead of it (ours, or the proxy's queue) does.
                busy=queued > 0 or bool(e.prefill), kv_usage=e.load.kv_usage, streams=len(e.streams),
                base_s=estimate.base_s, cost_per_token_s=estimate.cost_per_token_s, observed=estimate.observed > 0,
            ))
        return views

    # -- the router's own requests ------------------------------------------------------------------
    def dispatched(self, url: str, *, uncached: int, predicted_ttft_s: float) -> int:
        """Count a request sent to `url`; returns its handle for `first_token` and `finished`."""
        state = self.endpoints[url]
        handle = next(self._ids)
        now = time.perf_counter()
        state.prefill[handle] = InFlight(tokens=state.prefill_tokens_ahead(now) + uncached, uncached=uncached,
                                         sent=now, first_token_due=now + predicted_ttft_s)
        state.streams.add(handle)
        self.mean_uncached = _MEAN_DECAY * self.mean_uncached + (1 - _MEAN_DECAY) * uncached
        return handle

    def first_token(self, url: str, handle: int, *, ttft_s: float) -> None:
        state = self.endpoints.get(url)
        request = None if state is None else state.prefill.pop(handle, None)
        if state is not None and request is not None:
            state.model.observe(tokens=request.tokens, ttft_s=ttft_s)

    def finished(self, url: str, handle: int) -> None:
        state = self.endpoints.get(url)
        if state is not None:
            state.prefill.pop(handle, None)
            state.streams.discard(handle)

    # -- probing ------------------------------------------------------------------------------------
    async def poll_forever(self, client: httpx.AsyncClient) -> None:
        while True:
            await self.poll_once(client)
            await asyncio.sleep(self.scrape_interval_s if self.ready_urls() else FAST_PROBE_S)

    async def poll_once(self, client: httpx.AsyncClient) -> None:
        states = list(self.endpoints.values())
        await asyncio.gather(*(self._poll(client, s) for s in states))

    async def _poll(self, client: httpx.AsyncClient, state: EndpointState) -> None:
        if state.probed:
            ready = await probe_ready(client, state.url)
            if ready != state.ready and self.endpoints.get(state.url) is state:
                log.info("endpoint %s is %s", state.url, "ready" if ready else "not ready")
                state.ready = ready
                self._notify()
        if state.ready:
            load = await scrape_load(client, state.url)
            if load is not None:
                state.load = load
