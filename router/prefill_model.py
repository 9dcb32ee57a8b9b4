"""How TTFT grows with the prefill work ahead of a request: ttft = base + tokens x cost. The router fits
one for the whole fleet (`Fleet.model`): per endpoint, each base learned its endpoint's uncounted waits
and the lowest drew the requests.

Fitted online by least squares with exponential forgetting (each new sample weighs as much as the
last `1 / (1 - DECAY)` together), so the model follows an endpoint that slows down (a noisy neighbour,
a longer context) within a few dozen requests. It starts from a prior held as two pseudo-samples that
fade like any other, so the first predictions are sane and the first observations dominate quickly.
A sample is (prefill tokens at dispatch: those ahead plus the request's uncached ones, the TTFT the
router measured from dispatch to the first token event).
"""

from __future__ import annotations

import dataclasses

DECAY = 0.95
# The prior: 20 ms to start and 1 ms a token, a small model on one CPU core. Only its shape matters
# much: it is forgotten after a handful of observations.
PRIOR_BASE_S = 0.02
PRIOR_COST_PER_TOKEN_S = 0.001
_PRIOR_SPAN = 1000.0  # tokens between the two prior pseudo-samples
_PRIOR_WEIGHT = 0.5


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PrefillEstimate:
    base_s: float
    cost_per_token_s: float
    observed: int  # real samples seen


class PrefillModel:
    def __init__(self, *, base_s: float = PRIOR_BASE_S, cost_per_token_s: float = PRIOR_COST_PER_TOKEN_S) -> None:
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self.observed = 0
        for x in (0.0, _PRIOR_SPAN):
            self._add(x, base_s + cost_per_token_s * x, _PRIOR_WEIGHT)
        self._estimate = PrefillEstimate(base_s=base_s, cost_per_token_s=cost_per_token_s, observed=0)

    def _add(self, x: float, y: float, weight: float) -> None:
        self._w += weight
        self._x += weight * x
        self._y += weight * y
        self._xx += weight * x * x
        self._xy += weight * x * y

    def observe(self, *, tokens: float, ttft_s: float) -> None:
        for name in ("_w", "_x", "_y", "_xx", "_xy"):
            setattr(self, name, getattr(self, name) * DECAY)
        self._add(max(tokens, 0.0), max(ttft_s, 0.0), 1.0)
        self.observed += 1
        self._estimate = self._fit()

    def _fit(self) -> PrefillEstimate:
        mean_x, mean_y = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mean_x * mean_x
        cov = self._xy / self._w - mean_x * mean_y
        previous = self._estimate
        # Samples all of about one size say nothing about the slope: keep the last one and refit the base.
        cost = cov / var if var > 1e-9 * max(1.0, mean_x * mean_x) else previous.cost_per_token_s
        cost = max(cost, 1e-7)
        base = max(mean_y - cost * mean_x, 0.0)
        return PrefillEstimate(base_s=base, cost_per_token_s=cost, observed=self.observed)

    @property
    def estimate(self) -> PrefillEstimate:
        return self._estimate
