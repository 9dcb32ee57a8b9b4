"""The engine over int8 KV pools (kv_cache_dtype int8, attention/kv_int8.py): the pool's size, prefix-cache
hits that equal misses, and what it costs in quality. Speculation over them: tests/engine/test_spec_decode_tiny.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from decodeservice.engine import Engine, SamplingParams
from decodeservice.engine.attention import native_decode
from decodeservice.engine.attention.paged_views import PagedViewsBackend
from decodeservice.engine.quant import detect_cpu
from decodeservice.engine.runner import kv_bytes_per_block
from tests.conftest import ModelBundle

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)


def test_an_int8_pool_holds_each_row_in_d_plus_4_bytes(tiny: ModelBundle) -> None:
    cfg = tiny.model.config
    engine = tiny.engine(kv_cache_dtype="int8", kv_cache_gib=0.01)
    k_cache, v_cache = engine.runner.kv_caches[0]
    assert k_cache.dtype == v_cache.dtype == torch.int8
    assert k_cache.shape[1:] == (16, cfg.num_kv_heads, cfg.head_dim + 4)
    per_block = kv_bytes_per_block(cfg, 16, torch.int8, cfg.num_layers)
    assert per_block == 2 * cfg.num_layers * 16 * cfg.num_kv_heads * (cfg.head_dim + 4)
    assert k_cache.shape[0] == int(0.01 * 2**30 // per_block)
    fp32 = tiny.engine(kv_cache_gib=0.01)  # the tiny model runs fp32: 4 bytes a value
    assert fp32.runner.kv_caches[0][0].shape[0] * 4 * cfg.head_dim == pytest.approx(
        k_cache.shape[0] * (cfg.head_dim + 4), rel=0.01)
    assert engine.runner.attention_backend.kv_int8  # type: ignore[attr-defined]


def test_a_prefix_hit_over_int8_rows_equals_the_miss(tiny: ModelBundle) -> None:
    # The miss computes the prompt's K/V and attends to them as the pool will hold them, so a later hit
    # that reads them back from the pool continues alike.
    document = list(range(1000, 1150))
    question = list(range(300, 310))
    cached = tiny.engine(kv_cache_dtype="int8", block_size=16, max_num_batched_tokens=64, num_gpu_blocks_override=64)
    cached.generate([document + [5, 6, 7]], GREEDY)
    hit = cached.generate([document + question], GREEDY)[0]
    assert hit.metrics.num_cached_tokens == 16 * (len(document) // 16)
    fresh = tiny.engine(kv_cache_dtype="int8", block_size=16, max_num_batched_tokens=64, num_gpu_blocks_override=64,
                        enable_prefix_caching=False)
    miss = fresh.generate([document + question], GREEDY)[0]
    assert miss.metrics.num_cached_tokens == 0
    assert hit.token_ids == miss.token_ids
    assert hit.logprobs is not None and miss.logprobs is not None
    gap = max(abs(a.logprob - b.logprob) for a, b in zip(hit.logprobs, miss.logprobs, strict=True))
    # fp32 summation order only: 4e-6 measured. Fresh K/V attended unrounded (the rows' values not swapped
    # in before attention) gave 3e-3.
    assert gap < 1e-4, gap


def test_int8_rows_decode_the_bundled_model_close_to_its_own_pool(bundled: ModelBundle) -> None:
    # What int8 rows cost on the real model: per-token logprobs of the same greedy continuation, the int8
    # engine's against the activations' own pool (fp32: the session's bundled model is unquantized). Measured (AMD EPYC, AVX-512):
    # at most 0.023 over these 8 positions.
    text = ("The survey team walked the northern ridge at dawn, logging every spring, path and ruined wall they "
            "passed. Their notes describe the weather, the soil, the birds they heard and the distance covered. ") * 6
    prompt = bundled.tokenizer.encode(text + "Question: what did the team log on the ridge?")
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=0)
    engine = bundled.engine(kv_cache_gib=0.05, max_model_len=1024, kv_cache_dtype="int8")
    # The activations' dtype asked for by name keeps its own pool, even where auto would take int8 rows.
    activations = str(engine.dtype).removeprefix("torch.")
    reference = bundled.engine(kv_cache_gib=0.05, max_model_len=1024, dtype=activations)
    assert reference.kv_dtype == reference.dtype == engine.dtype
    base = reference.generate([prompt], params)[0]
    backend = engine.runner.attention_backend
    assert isinstance(backend, PagedViewsBackend)
    assert (backend.kernel is not None) == (native_decode.decode_extension() is not None)
    # Score base's tokens under the int8 engine one prefix at a time, so a flipped near-tie does not fork the text.
    gaps = []
    for i, token in enumerate(base.token_ids[:8]):
        out = engine.generate([prompt + base.token_ids[:i]], SamplingParams(max_tokens=1, temperature=0.0,
                                                                             logprobs=20))[0]
        assert out.logprobs is not None
        top = out.logprobs[0].top
        assert token in top, f"position {i}: the default pool's token is not in the int8 pool's top 20"
        assert base.logprobs is not None
        gaps.append(abs(top[token] - base.logprobs[i].logprob))
    assert max(gaps) < 0.1, gaps


def test_auto_takes_int8_rows_where_the_activations_are_fp32_for_want_of_native_bf16(bundled_gguf_path: Path,
                                                                                     bundled: ModelBundle) -> None:
    # The default engine (int4 weights, precision by machine). Both branches run in CI: natively on an
    # AVX-512 machine, and under scripts/test.sh's AVX2 caps.
    engine = Engine.from_pretrained(str(bundled_gguf_path), max_model_len=512, kv_cache_gib=0.05)
    assert engine.model.weight_format == "int4"
    if detect_cpu().native_bf16:
        assert engine.kv_dtype == engine.dtype == torch.bfloat16
        assert engine.kv_dtype_reason == "auto: the activations' dtype"
    elif native_decode.decode_extension() is None:  # no kernel reads int8 rows in place: they would be slower
        assert engine.kv_dtype == engine.dtype == torch.float32
    else:
        assert engine.dtype == torch.float32 and engine.kv_dtype == torch.int8
        assert "want of native bf16" in engine.kv_dtype_reason
        assert engine.runner.kv_caches[0][0].dtype == torch.int8
        out = engine.generate([engine.tokenizer.encode("The capital of France is")], GREEDY)[0]
        assert "Paris" in engine.tokenizer.decode(out.token_ids)
    # Unquantized weights (the fp32 bundled model here) keep their own pool on any CPU.
    assert bundled.engine(kv_cache_gib=0.05, max_model_len=512).kv_dtype == torch.float32
