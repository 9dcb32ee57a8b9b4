"""Paged decoding (block tables, prefix cache, chunked prefill, batching) equals full recompute."""

from __future__ import annotations

import math

import torch

from decodeservice.engine import SamplingParams
from tests.conftest import ModelBundle

PROMPTS = [
    list(range(100, 137)),  # 37 tokens: several chunks and a partial block
    list(range(100, 137)) + [7, 8, 9, 10, 11, 12],  # shares 2 full blocks with the first (block size 16)
    [5, 6, 7],
    list(range(2000, 2070)),
]


def dense_logprobs(bundle: ModelBundle, tokens: list[int]) -> torch.Tensor:
    logits = bundle.model.forward_dense(torch.tensor(tokens))  # (T, V)
    return torch.log_softmax(logits, dim=-1)


def test_paged_matches_dense_recompute(tiny: ModelBundle) -> None:
    # A budget of 24 tokens per step forces chunked prefill; all prompts run in one batch.
    engine = tiny.engine(block_size=16, max_num_batched_tokens=24, max_model_len=256,
                         num_gpu_blocks_override=64)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = engine.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert len(out.token_ids) == 12
        full = prompt + out.token_ids
        reference = dense_logprobs(tiny, full)
        assert out.logprobs is not None
        for i, (token, logprob) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
            row = reference[len(prompt) - 1 + i]
            assert token == int(row.argmax()), f"token {i} differs from full recompute"
            assert math.isclose(logprob.logprob, float(row[token]), abs_tol=1e-4)


def test_prefix_cache_hit_matches_dense(tiny: ModelBundle) -> None:
    engine = tiny.engine(block_size=16, max_num_batched_tokens=64, max_model_len=256, num_gpu_blocks_override=64)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    first = engine.generate([PROMPTS[0]], params)[0]
    second = engine.generate([PROMPTS[1]], params)[0]
    stats = engine.stats()
    assert stats.prefix_cache_hits == 32, "the two shared full blocks should come from the cache"
    assert second.metrics.num_cached_tokens == 32
    for prompt, out in ((PROMPTS[0], first), (PROMPTS[1], second)):
        reference = dense_logprobs(tiny, prompt + out.token_ids)
        assert out.logprobs is not None
        for i, token in enumerate(out.token_ids):
            row = reference[len(prompt) - 1 + i]
            assert token == int(row.argmax())
            assert math.isclose(out.logprobs[i].logprob, float(row[token]), abs_tol=1e-4)


def test_batched_equals_alone(tiny: ModelBundle) -> None:
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    together = tiny.engine(max_model_len=256, num_gpu_blocks_override=64).generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, together, strict=True):
        alone = tiny.engine(max_model_len=256, num_gpu_blocks_override=64).generate([prompt], params)[0]
        assert alone.token_ids == out.token_ids
