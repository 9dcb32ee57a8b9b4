"""`AsyncEngine.launch`: the thread that builds the engine is the one that steps it, and a failed build
reaches the caller (one thread, one OpenMP pool: engine/async_engine.py says why)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from decodeservice.engine import AsyncEngine, Engine, ModelLoadError, SamplingParams
from tests.conftest import ModelBundle


async def test_launch_builds_and_steps_on_one_thread(tiny: ModelBundle) -> None:
    built_on: list[int] = []
    stepped_on: set[int] = set()

    def factory() -> Engine:
        built_on.append(threading.get_ident())
        engine = tiny.engine(max_model_len=64, num_gpu_blocks_override=8)
        step = engine.step

        def recorded_step():  # type: ignore[no-untyped-def]
            stepped_on.add(threading.get_ident())
            return step()

        engine.step = recorded_step  # type: ignore[method-assign]
        return engine

    aengine = await AsyncEngine.launch(factory)
    try:
        outs = [o async for o in aengine.generate([1, 2, 3], SamplingParams(max_tokens=3, temperature=0.0))]
        assert outs[-1].finished and len(outs[-1].token_ids) == 3
        assert stepped_on == set(built_on) and built_on[0] != threading.get_ident()
        assert aengine.is_alive
    finally:
        aengine.shutdown()
    assert not aengine.is_alive


async def test_launch_hands_a_failed_build_to_the_caller() -> None:
    def factory() -> Engine:
        raise ModelLoadError("no weights here")

    with pytest.raises(ModelLoadError, match="no weights here"):
        await asyncio.wait_for(AsyncEngine.launch(factory), timeout=30)
