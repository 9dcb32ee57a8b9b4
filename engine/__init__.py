"""DecodeService's torch engine: paged KV cache, prefix caching, continuous batching, speculation.

    from decodeservice.engine import Engine, SamplingParams
    engine = Engine.from_pretrained("smollm2-135m")
    outs = engine.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0.0))

The names below load on first use (PEP 562), so `decodeservice.engine.config` (the defaults the CLI
and the operator's CRD read) can be imported without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

_HOMES = {
    "AsyncEngine": "async_engine",
    "ConfigError": "errors",
    "Engine": "engine",
    "EngineConfig": "config",
    "EngineDeadError": "errors",
    "EngineError": "errors",
    "EngineStats": "outputs",
    "InvalidRequestError": "errors",
    "ModelConfig": "config",
    "ModelLoadError": "errors",
    "PromptTooLongError": "errors",
    "RequestOutput": "outputs",
    "SamplingParams": "sampling_params",
    "SpecDecodeStats": "outputs",
    "SpeculativeConfig": "config",
    "TokenLogprob": "outputs",
    "UnknownModelError": "errors",
    "UnsupportedModelError": "errors",
}
__all__ = [  # ruff and mypy read the re-exports from this literal; _HOMES says where each one lives
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


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value  # later lookups skip this function
    return value
