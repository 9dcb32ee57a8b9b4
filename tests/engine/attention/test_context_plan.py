"""attention/context_plan.py: where decodes leave the flash kernel is measured on this machine, cached,
and applied by the engine to its CPU backend."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from decodeservice.engine import Engine, EngineConfig, ModelConfig
from decodeservice.engine.attention.context_plan import CONTEXT_LADDER, choose_min_context
from decodeservice.engine.attention.paged_views import PagedViewsBackend
from decodeservice.engine.loader.gguf_loader import read_gguf_tokenizer
from decodeservice.engine.loader.registry import resolve_model_path
from decodeservice.engine.model import LlamaModel
from decodeservice.engine.quant.kernel_plan import first_win

SHAPES = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "num_layers": 2, "block_size": 16}


def test_the_threshold_is_measured_then_read_back(tmp_path: Path) -> None:
    choice = choose_min_context(dtype=torch.bfloat16, cache_dir=tmp_path, **SHAPES)
    assert choice.source == "measured"
    assert set(choice.timings_us["flash"]) == set(choice.timings_us["matmul"]) == set(CONTEXT_LADDER)
    assert all(us > 0 for path in choice.timings_us.values() for us in path.values())
    assert choice.min_context == first_win(choice.timings_us["matmul"], choice.timings_us["flash"])
    again = choose_min_context(dtype=torch.bfloat16, cache_dir=tmp_path, **SHAPES)
    assert again.source.startswith(str(tmp_path)) and again.min_context == choice.min_context
    assert again.timings_us == choice.timings_us
    # other shapes are another key: measured for themselves
    other = choose_min_context(dtype=torch.bfloat16, cache_dir=tmp_path, **{**SHAPES, "head_dim": 32})
    assert other.source == "measured" and len(list(tmp_path.glob("attention-*.json"))) == 2


def tiny_engine(dtype: str) -> Engine:
    cfg = ModelConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, max_position_embeddings=512)
    model = LlamaModel(cfg).eval().to(getattr(torch, dtype))
    return Engine(model=model, tokenizer=read_gguf_tokenizer(resolve_model_path("smollm2-135m")),
                  config=EngineConfig(num_gpu_blocks_override=32, dtype=dtype))


def test_the_engine_applies_it_to_bf16_kv_caches_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DECODESERVICE_KERNEL_CACHE", str(tmp_path))
    bf16 = tiny_engine("bfloat16")
    backend = bf16.runner.attention_backend
    assert isinstance(backend, PagedViewsBackend) and bf16.attention_choice is not None
    assert backend.matmul_from == bf16.attention_choice.min_context
    assert list(tmp_path.glob("attention-*.json"))  # kept for the next start
    assert tiny_engine("float32").attention_choice is None  # decode_matmul.py never runs on fp32 caches
