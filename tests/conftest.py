"""Shared fixtures. The real model is loaded once per test session (about 20 s here)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from decodeservice.engine import Engine, EngineConfig, ModelConfig
from decodeservice.engine.engine import build_model
from decodeservice.engine.model import LlamaModel
from decodeservice.engine.tokenizer import Tokenizer

torch.set_num_threads(2)


@dataclass(frozen=True)
class ModelBundle:
    model: LlamaModel
    tokenizer: Tokenizer

    def engine(self, **config: Any) -> Engine:
        """A fresh engine (own KV pool and scheduler) over the shared, read-only weights."""
        return Engine(model=self.model, tokenizer=self.tokenizer, config=EngineConfig(**config))


@pytest.fixture(scope="session")
def bundled_gguf_path() -> Path:
    from decodeservice.engine.loader import ensure_model

    return ensure_model("smollm2-135m", progress=False)


@pytest.fixture(scope="session")
def bundled(bundled_gguf_path: Path) -> ModelBundle:
    from decodeservice.engine.loader import load_model

    loaded = load_model(bundled_gguf_path, dtype=torch.float32)
    return ModelBundle(build_model(loaded.config, loaded.weights, EngineConfig()), loaded.tokenizer)


def make_tiny_model(tokenizer: Tokenizer, *, seed: int = 0, num_layers: int = 2) -> LlamaModel:
    """A random Llama small enough to test exhaustively, over the bundled tokenizer's vocabulary."""
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=128,
                      num_layers=num_layers, num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0,
                      max_position_embeddings=512, tie_word_embeddings=False,
                      eos_token_ids=tokenizer.eos_token_ids)
    torch.manual_seed(seed)
    model = LlamaModel(cfg)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.3)  # peaky logits: greedy comparisons are not decided by ties
    return model.eval()


@pytest.fixture(scope="session")
def tiny(bundled: ModelBundle) -> ModelBundle:
    return ModelBundle(make_tiny_model(bundled.tokenizer), bundled.tokenizer)


@pytest.fixture(scope="session")
def tiny_factory(bundled: ModelBundle) -> Callable[..., ModelBundle]:
    def factory(**kwargs: Any) -> ModelBundle:
        return ModelBundle(make_tiny_model(bundled.tokenizer, **kwargs), bundled.tokenizer)

    return factory
