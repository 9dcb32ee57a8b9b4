"""Fleet admission: when no endpoint can meet the objective the router sheds with 429 + Retry-After,
as the proxy does, `batch` before `interactive`."""

from __future__ import annotations

import asyncio

from decodeservice.proxy.policy import PriorityClass
from decodeservice.router.dispatch import shed_objective
from tests.router.conftest import chat, fake_engines, metric, running_router


def test_batch_is_shed_before_interactive() -> None:
    assert shed_objective(PriorityClass.BATCH, 1.0) < shed_objective(PriorityClass.INTERACTIVE, 1.0) == 1.0


async def test_a_request_no_endpoint_can_serve_within_the_objective_gets_429() -> None:
    async with fake_engines(1, ttft_s=0.3, itl_s=0.01) as (engine,), \
            running_router([engine.url], policy={"slo": {"ttftMs": 100}}) as (app, client):
        for _ in range(3):  # the router learns this endpoint takes 0.3 s to a first token
            assert (await client.post("/v1/chat/completions", json=chat("warm up"))).status_code == 200
        busy = asyncio.create_task(client.post("/v1/chat/completions", json=chat("long", max_tokens=50)))
        await engine.wait_for(lambda e: e.active == 1)
        for cls in ("interactive", "batch"):
            response = await client.post("/v1/chat/completions", json=chat("one more"), headers={"x-priority": cls})
            assert response.status_code == 429, response.text
            assert int(response.headers["retry-after"]) >= 1
            assert response.json()["error"]["type"] == "rate_limit_exceeded"
        assert (await busy).status_code == 200
        text = (await client.get("/metrics")).text
        for cls in ("interactive", "batch"):
            assert metric(text, "decode_router:requests_shed_total", **{"class": cls, "reason": "slo"}) == 1
            assert metric(text, "decode_router:requests_total", **{"class": cls, "status": "429"}) == 1
        assert engine.started == 4  # the shed ones never reached the endpoint
        # Idle again: nothing is shed, however slow the endpoint (refusing could make no one faster).
        assert (await client.post("/v1/chat/completions", json=chat("alone"))).status_code == 200
