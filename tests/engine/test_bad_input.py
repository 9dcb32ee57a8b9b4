"""Every documented bad input raises its documented error, and the engine keeps working."""

from __future__ import annotations

import math
import struct
from pathlib import Path

import pytest

from decodeservice.engine import (
    AsyncEngine,
    ConfigError,
    Engine,
    InvalidRequestError,
    PromptTooLongError,
    SamplingParams,
    UnknownModelError,
    UnsupportedModelError,
)
from tests.conftest import ModelBundle


@pytest.mark.parametrize("kwargs, param", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"),
])
def test_bad_sampling_params(kwargs: dict[str, float], param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert info.value.param == param


def test_prompt_longer_than_context(tiny: ModelBundle) -> None:
    engine = tiny.engine(max_model_len=64, num_gpu_blocks_override=8)
    with pytest.raises(PromptTooLongError, match="64 tokens"):
        engine.add_request(list(range(64)), SamplingParams())
    with pytest.raises(InvalidRequestError):
        engine.add_request([], SamplingParams())
    with pytest.raises(InvalidRequestError):
        engine.add_request([tiny.model.config.vocab_size], SamplingParams())
    # Nothing was queued, and the engine still serves.
    assert not engine.has_unfinished_requests()
    assert engine.generate([1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0))[0].token_ids


def test_an_encoded_prompt_is_checked_once_where_it_is_made(tiny: ModelBundle) -> None:
    engine = tiny.engine(max_model_len=64, num_gpu_blocks_override=8)
    with pytest.raises(PromptTooLongError, match="64 tokens"):
        engine.encode_prompt(list(range(64)))
    with pytest.raises(InvalidRequestError) as info:
        engine.encode_prompt("")
    assert info.value.param == "prompt"
    encoded = engine.encode_prompt("Hello")
    assert encoded.token_ids == tiny.tokenizer.encode("Hello")
    out = engine.generate(tiny.tokenizer.encode("Hello"), SamplingParams(max_tokens=3, temperature=0.0))[0]
    request_id = engine.add_request(encoded, SamplingParams(max_tokens=3, temperature=0.0))
    finished = [o for _ in range(10) for o in engine.step() if o.finished]
    assert [(o.request_id, o.token_ids) for o in finished] == [(request_id, out.token_ids)]
    # generate checks every prompt before it queues any: a bad one leaves nothing running.
    with pytest.raises(InvalidRequestError):
        engine.generate([[1, 2, 3], []], SamplingParams(max_tokens=2))
    assert not engine.has_unfinished_requests()


async def test_async_engine_rejects_a_bad_prompt_in_the_callers_task(tiny: ModelBundle) -> None:
    aengine = AsyncEngine(tiny.engine(max_model_len=64, num_gpu_blocks_override=8))
    aengine.start()
    try:
        with pytest.raises(PromptTooLongError, match="64 tokens"):
            async for _ in aengine.generate(list(range(64)), SamplingParams()):
                pass
        with pytest.raises(InvalidRequestError):
            async for _ in aengine.generate([tiny.model.config.vocab_size], SamplingParams()):
                pass
        outs = [o async for o in aengine.generate([1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0))]
        assert outs[-1].finished and outs[-1].token_ids == [t for o in outs for t in o.new_token_ids]
        assert aengine.is_alive and aengine.num_unfinished == 0
    finally:
        aengine.shutdown()


def test_generation_stops_at_the_context_limit(tiny: ModelBundle) -> None:
    engine = tiny.engine(max_model_len=40, num_gpu_blocks_override=8)
    out = engine.generate(list(range(30)), SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 10


def test_unknown_model() -> None:
    with pytest.raises(UnknownModelError, match="smollm2-135m"):
        Engine.from_pretrained("no-such-model")


def test_corrupt_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + struct.pack("<I", 3) + b"\x00" * 7)
    with pytest.raises(UnsupportedModelError):
        Engine.from_pretrained(str(bad))
    not_gguf = tmp_path / "weights.gguf"
    not_gguf.write_bytes(b"this is not a model")
    with pytest.raises(UnsupportedModelError):
        Engine.from_pretrained(str(not_gguf))


@pytest.mark.parametrize("kwargs", [
    {"block_size": 12},
    {"max_num_seqs": 0},
    {"kv_cache_gib": -1.0},
    {"quantization": "int3"},
    {"quantization": "int4", "device": "cuda"},
    {"kv_cache_dtype": "int8", "device": "cuda"},
    {"kv_cache_dtype": "fp8"},
    {"speculative": {"method": "telepathy"}},
    {"speculative": {"method": "draft"}},
])
def test_bad_engine_config(tiny: ModelBundle, kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        Engine.from_pretrained("no-such-model", **kwargs)


def test_pool_smaller_than_one_sequence(tiny: ModelBundle) -> None:
    with pytest.raises(ConfigError, match="max_model_len"):
        tiny.engine(max_model_len=256, num_gpu_blocks_override=2)
