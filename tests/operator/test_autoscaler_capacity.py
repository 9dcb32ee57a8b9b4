"""The learned sustainable rate per replica and sizing on the offered rate (pure, hand-computed values)."""

from __future__ import annotations

import pytest

from decodeservice.operator.autoscaler.capacity import RateCapacity

UP, DOWN = 0.8, 0.5


def learned(*ticks: tuple[float, float | None]) -> float | None:
    c = RateCapacity()
    for r, s in ticks:
        c.observe(rate_per_replica=r, signal=s, up=UP, down=DOWN)
    return c.per_replica


def test_unknown_while_latency_is_flat_far_below_the_knee() -> None:
    assert learned((2.0, 0.3), (3.0, 0.45), (1.0, None)) is None  # flat latency says nothing about the knee
    c = RateCapacity()
    assert c.replicas_for(rate=10.0, backlog=0.0, utilization=0.85, drain_seconds=60.0) is None


def test_a_signal_in_the_band_gives_a_first_guess_before_any_breach() -> None:
    # Without it, a fleet that grew before a breach was seen (a queue spike, a burst) never learns a rate
    # and sizes on in-flight demand for good. The projection from the band is at most up / down x r.
    assert learned((2.0, 0.3), (3.0, 0.6)) == pytest.approx(3.0 * 0.8 / 0.6)
    assert learned((3.0, 0.6), (3.0, 0.3)) == pytest.approx(4.5)  # then calm raises it by <= 1.5 x r only


def test_a_breach_puts_the_knee_at_the_projected_rate_and_at_most_halves_it() -> None:
    assert learned((2.0, 1.0)) == pytest.approx(2.0 * 0.8 / 1.0)
    assert learned((2.0, 9.0)) == pytest.approx(1.0)  # s counted at most 2 x up: a queue explosion halves
    assert learned((2.0, 1.0), (3.0, 0.9)) == pytest.approx(1.6)  # the lower knee wins on a later breach
    assert learned((2.0, 1.0), (0.7, 1.5)) == pytest.approx(1.6)  # under half the knee: a backlog draining


def test_calm_raises_the_estimate_only_by_a_bounded_factor_of_the_rate_seen() -> None:
    # s 0.2 at 1.0/s: linear projection says 4.0/s, but latency is flat below the knee: at most 1.5 x 1.0
    assert learned((2.0, 0.8), (1.0, 0.2)) == pytest.approx(2.0)  # 1.5 is under what is known: kept
    assert learned((1.0, 1.0), (1.0, 0.2)) == pytest.approx(1.5)
    assert learned((1.0, 1.0), (1.2, 0.7)) == pytest.approx(1.2)  # in the band: that rate is sustainable


def test_sizing_drains_the_waiting_line_over_the_horizon_instead_of_counting_it_as_demand() -> None:
    c = RateCapacity()
    c.observe(rate_per_replica=1.0, signal=0.8, up=UP, down=DOWN)  # knee 1.0/s per replica
    assert c.replicas_for(rate=4.0, backlog=0.0, utilization=0.8, drain_seconds=60.0) == 5  # 4 / 0.8
    # 120 waiting drain at 2/s over a minute: 6/s in all -> 8 replicas, not 120 / a per-replica target
    assert c.replicas_for(rate=4.0, backlog=120.0, utilization=0.8, drain_seconds=60.0) == 8
    assert c.replicas_for(rate=0.0, backlog=0.0, utilization=0.8, drain_seconds=60.0) == 0
