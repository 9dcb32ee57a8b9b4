"""attention/context_plan.py: where decodes leave the flash kernel, and whether the native paged-decode
kernel takes them, is measured on this machine, cached, and applied by the engine to its CPU backend."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from decodeservice.engine import Engine, EngineConfig, ModelConfig
from decodeservice.engine.attention import native_decode
from decodeservice.engine.attention.context_plan import BATCH, CONTEXT_LADDER, choose_attention
from decodeservice.engine.attention.paged_views import PagedViewsBackend
from decodeservice.engine.loader.gguf_loader import read_gguf_tokenizer
from decodeservice.engine.loader.registry import resolve_model_path
from decodeservice.engine.model import LlamaModel
from decodeservice.engine.quant.kernel_plan import first_win

SHAPES = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "num_layers": 2, "block_size": 16}


def test_the_threshold_is_measured_then_read_back(tmp_path: Path) -> None:
    choice = choose_attention(dtype=torch.bfloat16, cache_dir=tmp_path, **SHAPES)
    assert choice.source == "measured"
    assert set(choice.timings_us["flash"]) == set(choice.timings_us["matmul"]) == set(CONTEXT_LADDER)
    assert all(us > 0 for path in choice.timings_us.values() for us in path.values())
    assert choice.min_context == first_win(choice.timings_us["matmul"], choice.timings_us["flash"])
    assert not choice.native_decode and "native" not in choice.timings_us  # head_dim 16: not the kernel's
    again = choose_attention(dtype=torch.bfloat16, cache_dir=tmp_path, **SHAPES)
    assert again.source.startswith(str(tmp_path)) and again.min_context == choice.min_context
    assert again.timings_us == choice.timings_us
    # other shapes are another key: measured for themselves
    other = choose_attention(dtype=torch.bfloat16, cache_dir=tmp_path, **{**SHAPES, "head_dim": 32})
    assert other.source == "measured" and len(list(tmp_path.glob("attention-*.json"))) == 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_the_native_kernel_is_raced_and_taken_where_it_wins(tmp_path: Path, dtype: torch.dtype) -> None:
    native = native_decode.decode_extension()
    if native is None:
        pytest.skip("the native kernel did not build here")
    shapes = {**SHAPES, "num_heads": 6, "head_dim": 64}
    choice = choose_attention(dtype=dtype, cache_dir=tmp_path, native=native, **shapes)
    timings = choice.timings_us
    assert set(timings["native"]) == set(CONTEXT_LADDER) and set(timings["batch_native"]) == {BATCH}
    assert ("matmul" in timings) == (dtype == torch.bfloat16)
    def torch_path(n: int) -> float:
        takes_gemm = choice.min_context is not None and n >= choice.min_context
        return timings["matmul"][n] if takes_gemm else timings["flash"][n]
    wins = (sum(timings["native"].values()) <= sum(torch_path(n) for n in CONTEXT_LADDER)
            and timings["batch_native"][BATCH] <= timings["batch_torch"][BATCH])
    assert choice.native_decode == wins
    # A machine where the kernel did not build keys (and measures) its choice apart.
    without = choose_attention(dtype=dtype, cache_dir=tmp_path, native=None, **shapes)
    assert without.source == "measured" and not without.native_decode and "native" not in without.timings_us


def tiny_engine(dtype: str, head_dim: int = 16) -> Engine:
    cfg = ModelConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=head_dim, max_position_embeddings=512)
    model = LlamaModel(cfg).eval().to(getattr(torch, dtype))
    return Engine(model=model, tokenizer=read_gguf_tokenizer(resolve_model_path("smollm2-135m")),
                  config=EngineConfig(num_gpu_blocks_override=32, dtype=dtype))


def test_the_engine_applies_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DECODESERVICE_KERNEL_CACHE", str(tmp_path))
    bf16 = tiny_engine("bfloat16")
    backend = bf16.runner.attention_backend
    assert isinstance(backend, PagedViewsBackend) and bf16.attention_choice is not None
    assert backend.matmul_from == bf16.attention_choice.min_context
    assert list(tmp_path.glob("attention-*.json"))  # kept for the next start
    fp32 = tiny_engine("float32", head_dim=32)
    assert fp32.attention_choice is not None and fp32.attention_choice.min_context is None  # no GEMMs on fp32
    native = fp32.attention_choice.native_decode
    assert fp32.runner.attention_backend.decode_kernel is (native_decode.decode_extension() if native else None)
