"""SLO attainment and the latency model over their sliding windows."""

from __future__ import annotations

from decodeservice.proxy.policy import PriorityClass, SloPolicy
from decodeservice.proxy.slo import LatencyModel, RequestOutcome, SloTracker


def _outcome(t: float, ttft: float | None, itls: tuple[float, ...] = ()) -> RequestOutcome:
    return RequestOutcome(priority=PriorityClass.BATCH, finished=t, ttft=ttft, upstream_ttft=ttft,
                          service_time=1.0 + t, e2e=1.0, itls=itls, output_tokens=len(itls) + 1)


def test_attainment_counts_objectives_and_forgets_old_requests() -> None:
    tracker = SloTracker(SloPolicy(ttft_ms=100, itl_ms=10, percentile=50, window_seconds=10))
    tracker.record(_outcome(0.0, 0.05, (0.005, 0.005, 0.5)))  # p50 ITL 5 ms: meets both
    tracker.record(_outcome(1.0, 0.5, (0.005,)))  # TTFT missed
    tracker.record(_outcome(2.0, None))  # no token: TTFT missed
    tracker.record(_outcome(3.0, 0.01, (0.02, 0.03)))  # ITL missed
    att = tracker.attainment(PriorityClass.BATCH, now=5.0)
    assert att is not None
    assert (att.ttft, att.itl, att.all, att.requests) == (0.5, 0.75, 0.25, 4)
    later = tracker.attainment(PriorityClass.BATCH, now=12.5)  # the first three fell out of the window
    assert later is not None and (later.all, later.requests) == (0.0, 1)
    assert tracker.attainment(PriorityClass.INTERACTIVE, now=5.0) is None


def test_a_non_streamed_answer_is_not_judged_against_token_objectives() -> None:
    """Its time to the whole body is neither a first token nor a gap: it leaves the window alone."""
    tracker = SloTracker(SloPolicy(ttft_ms=100, itl_ms=10, percentile=50, window_seconds=10))
    for t in range(3):
        assert tracker.record(_outcome(float(t), 0.01, (0.001,))) is not None
    for t in range(3, 5):
        whole = RequestOutcome(priority=PriorityClass.BATCH, finished=float(t), ttft=None, upstream_ttft=None,
                               service_time=0.01, e2e=0.01, itls=(), output_tokens=5, streamed=False)
        assert tracker.record(whole) is None
    att = tracker.attainment(PriorityClass.BATCH, now=5.0)
    assert att is not None and (att.ttft, att.itl, att.all, att.requests) == (1.0, 1.0, 1.0, 3)


def test_latency_model_windows() -> None:
    model = LatencyModel(window_seconds=10)
    assert model.ttft_quantile(0.9, now=0.0) is None and model.mean_service_time(now=0.0) is None
    for t in range(5):
        model.record(_outcome(float(t), 0.1 * (t + 1)))
    assert model.ttft_quantile(1.0, now=5.0) == 0.5
    assert model.mean_service_time(now=5.0) == 3.0
    assert model.mean_service_time(now=13.5) == 5.0  # only t=4 is left
