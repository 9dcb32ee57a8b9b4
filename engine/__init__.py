"""DecodeService's torch engine: paged KV cache, prefix caching, continuous batching, speculation.

    from decodeservice.engine import Engine, SamplingParams
    engine = Engine.from_pretrained("smollm2-135m")
    outs = engine.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0.0))
"""

from decodeservice.engine.async_engine import AsyncEngine
from decodeservice.engine.config import EngineConfig, ModelConfig, SpeculativeConfig
from decodeservice.engine.engine import Engine
from decodeservice.engine.errors import (
    ConfigError,
    EngineDeadError,
    EngineError,
    InvalidRequestError,
    ModelLoadError,
    PromptTooLongError,
    UnknownModelError,
    UnsupportedModelError,
)
from decodeservice.engine.outputs import EngineStats, RequestOutput, SpecDecodeStats, TokenLogprob
from decodeservice.engine.sampling_params import SamplingParams

__all__ = [
    "AsyncEngine",
    "ConfigError",
    "Engine",
    "EngineConfig",
    "EngineDeadError",
    "EngineError",
    "EngineStats",
    "InvalidRequestError",
    "ModelConfig",
    "ModelLoadError",
    "PromptTooLongError",
    "RequestOutput",
    "SamplingParams",
    "SpecDecodeStats",
    "SpeculativeConfig",
    "TokenLogprob",
    "UnknownModelError",
    "UnsupportedModelError",
]
