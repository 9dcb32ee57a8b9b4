"""Scale to zero and back, on the router's signal (routing mode router, autoscaling.mode builtin).

With no ready pod there are no proxies to scrape, so the pod-side decision (`decide.py`) cannot see demand.
The router can: while no endpoint is ready it holds requests and reports them as
`decode_router:requests_held` (summed over the routers), and it reports when it last received a
completion request as `decode_router:last_request_timestamp_seconds` (the newest over the routers).

- From zero: the Deployment has 0 replicas and some router holds a request. One replica is started on
  that tick, with no stabilization window: each held request waits for it.
- To zero: only with minReplicas 0, when no router has received a request for `idleSeconds`, none holds
  one and no proxy has a request in flight or queued. A router that has received none since it started
  (the gauge is 0) counts as idle since the autoscaler first saw it so.
- Never on missing data: with no router read this tick, the pod-side decision stands (it never goes
  below one replica by itself).
- A replica that is starting (0 -> 1 written, its pod not Ready) is not missing capacity: the Deployment
  already has 1 replica, so held requests do not ask for another; the pod-side decision counts starting
  pods as capacity too.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from decodeservice.operator.autoscaler.scrape import PodTarget, ScrapeError, ScrapeSettings, _fetch
from decodeservice.operator.autoscaler.types import PodSample, ScaleDecision
from decodeservice.operator.autoscaler.window import demand

HELD = "decode_router:requests_held"
LAST_REQUEST = "decode_router:last_request_timestamp_seconds"


@dataclass(frozen=True, kw_only=True)
class RouterSignal:
    """What the routers said on one tick."""

    held: float  # requests held for want of a ready endpoint, summed over the routers read
    last_request: float  # unix seconds of the newest completion request any router received (0: none yet)
    routers: int  # routers read
    failed: int  # ready routers that could not be read


def parse_router_metrics(text: str) -> tuple[float, float]:
    """(held, last request time) from one router's `/metrics`; ScrapeError when either series is missing."""
    held: float | None = None
    last: float | None = None
    try:
        families = list(text_string_to_metric_families(text))
    except Exception as exc:  # the parser raises ValueError, IndexError, TypeError, ... on garbage
        raise ScrapeError(f"unparseable metrics body: {type(exc).__name__}: {str(exc)[:200]}") from None
    for family in families:
        for s in family.samples:
            if s.name not in (HELD, LAST_REQUEST):
                continue
            value = float(s.value)
            if not math.isfinite(value) or value < 0:
                raise ScrapeError(f"{s.name} is {value!r}, not a finite non-negative number")
            if s.name == HELD:
                held = (held or 0.0) + value  # one series per class
            else:
                last = max(last or 0.0, value)
    if held is None or last is None:
        raise ScrapeError(f"no {HELD} or {LAST_REQUEST} series: not a DecodeService router's /metrics")
    return held, last


async def _read(session: aiohttp.ClientSession, target: PodTarget, settings: ScrapeSettings) -> tuple[float, float] | str:
    try:
        text = await asyncio.wait_for(_fetch(session, target, settings), timeout=settings.timeout_seconds)
        return parse_router_metrics(text)
    except ScrapeError as exc:
        return str(exc)
    except TimeoutError:
        return f"no answer within {settings.timeout_seconds:g}s"
    except (aiohttp.ClientError, OSError) as exc:
        return f"{type(exc).__name__}: {exc}"


async def scrape_routers(session: aiohttp.ClientSession, targets: Sequence[PodTarget], *,
                         settings: ScrapeSettings) -> RouterSignal:
    results = await asyncio.gather(*(_read(session, t, settings) for t in targets))
    read = [r for r in results if not isinstance(r, str)]
    return RouterSignal(held=sum(h for h, _ in read), last_request=max((t for _, t in read), default=0.0),
                        routers=len(read), failed=len(results) - len(read))


class IdleClock:
    """Since when the routers have been idle, across ticks (one per DecodeService)."""

    def __init__(self, wall: Callable[[], float]) -> None:
        self._wall = wall
        self._quiet_since: float | None = None  # first tick whose routers had received no request at all

    def idle_for(self, signal: RouterSignal) -> float | None:
        """Seconds since the last request the routers received; None when no router was read."""
        now = self._wall()
        if signal.routers == 0:
            return None
        if signal.last_request > 0:
            self._quiet_since = None
            return max(now - signal.last_request, 0.0)
        if self._quiet_since is None:
            self._quiet_since = now
        return now - self._quiet_since


def with_router_signal(decision: ScaleDecision, *, signal: RouterSignal, idle_for: float | None,
                       samples: Sequence[PodSample], min_replicas: int, max_replicas: int,
                       idle_seconds: float) -> ScaleDecision:
    """The pod-side decision, overruled where the router's signal says to leave or reach zero."""
    current = decision.current_replicas
    if current == 0:
        if signal.held > 0 and max_replicas >= 1:
            return replace(decision, desired_replicas=1,
                           reason=f"0 -> 1: scale from zero, {signal.held:.0f} request(s) held at the router")
        return decision
    if min_replicas > 0 or decision.desired_replicas > current or idle_for is None:
        return decision
    busy = signal.held + sum(demand(s) for s in samples)
    if busy > 0 or idle_for < idle_seconds:
        return decision
    return replace(decision, desired_replicas=0,
                   reason=f"{current} -> 0: no request at the router for {idle_for:.0f} s (idleSeconds "
                          f"{idle_seconds:g}) and none in flight: scaled to zero")
