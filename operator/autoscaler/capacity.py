"""How many requests per second one replica sustains at the SLO, learned from the signal, and sizing on it.

Latency says whether there are too few replicas, not how many are needed; the arrival rate does, once
one replica's sustainable rate is known. It is learned where latency reveals it (as the knee of the
demand curve in `decide._calibrate`):

- a signal s at or over the up threshold while each ready replica took r requests/s puts the knee at
  r x up / s at most (s counted at most twice the threshold, so a queue explosion halves it at most),
  unless r is under half the knee already known: then the latency is a backlog's being drained;
- a signal under the down threshold at r says the knee is above r: by the same projection, but at most
  `max_raise` x r, because latency is flat far below the knee and a linear projection from there is
  wildly optimistic;
- a signal in between (near the knee) says r is sustainable.

Sizing: the fewest replicas that serve the offered rate, plus the waiting line drained over
`drain_seconds`, at `utilization` of the learned rate. The waiting line is a one-off (it piled up while
pods were starting), so it is drained over a horizon, not counted as standing demand.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class RateEstimate:
    """The fleet's offered load on one tick, from `window.offered_rate` and the newest samples."""

    rate: float  # requests/s offered to the scraped pods (stable window)
    rate_recent: float  # the same since the ready pods last grew (None-free: 0 when not measurable)
    rate_panic: float  # the same over the panic window
    backlog: float  # requests without a first token now (engine waiting + proxy queues), fleet total
    recent_span: float  # seconds the recent rate covers (0: not measurable yet)


class RateCapacity:
    """The learned sustainable rate per replica (None until the signal first revealed it)."""

    def __init__(self, *, max_raise: float = 1.5) -> None:
        self.per_replica: float | None = None
        self.max_raise = max_raise

    def observe(self, *, rate_per_replica: float, signal: float | None, up: float, down: float) -> None:
        """One tick's evidence: the rate each ready replica took and the signal it produced."""
        r, s = rate_per_replica, signal
        if s is None or not math.isfinite(r) or r <= 0:
            return
        known = self.per_replica
        if s >= up:
            if known is not None and r < known / 2:
                return  # latency of a backlog being drained (or a sick pod), not of this rate: not the knee
            est = r * up / min(s, 2 * up)
            self.per_replica = est if known is None else min(known, est)
        elif known is None:
            if s >= down:  # in the band: near enough the knee for the projection to be a fair first guess
                self.per_replica = r * up / s
            return  # far below the knee with no breach seen yet: its height is unknown
        elif s < down:
            self.per_replica = max(known, r * min(up / max(s, 1e-9), self.max_raise))
        else:
            self.per_replica = max(known, r)

    def replicas_for(self, *, rate: float, backlog: float, utilization: float, drain_seconds: float) -> int | None:
        """The fewest replicas serving `rate` and draining `backlog` within `drain_seconds`; None: unknown."""
        cap = self.per_replica
        if cap is None:
            return None
        return max(math.ceil((rate + backlog / drain_seconds) / (cap * utilization) - 1e-9), 0)
