"""A prefix-cache hit computes what the miss computes: the same request gets the same answer whether 1 or
64 blocks of its prompt were cached, however its prompt was chunked, with or without a decode beside it.

Each path that can serve a hit: a prompt chunk over a cached prefix (fp32: bit for bit; the default int4
weights), a speculative verify over a cached prefix, int8 KV pools. The cause they guard: a prompt row's
attention (one SDPA over a fresh prompt, a merge of the cached prefix with a fresh piece on a hit) and
its projections (a path chosen by the call's row count) rounded differently on a hit
(benchmarks/prefix_consistency.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from decodeservice.engine import Engine, EngineConfig, RequestOutput, SamplingParams, SpeculativeConfig
from decodeservice.engine.attention import native_decode
from decodeservice.engine.engine import build_model
from decodeservice.engine.loader import load_model
from tests.conftest import ModelBundle

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(native_decode.decode_extension() is None,
                       reason="prompt rows take one function through the native paged-decode kernel, not built here"),
]

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=5)
BLOCK = 16


def _document(bundled: ModelBundle) -> list[int]:
    text = ("The engine keeps a paged KV cache. Blocks of sixteen tokens are hashed by their content and the "
            "content before them, so a prompt that starts like an earlier one reads those blocks instead of "
            "computing them again. Prefill is compute-bound; decode reads every weight once a step. ") * 3
    return bundled.tokenizer.encode(text, add_special_tokens=False)


def _hit_and_miss(engines: tuple[Engine, Engine], prefix: list[int], tail: list[int],
                  beside: list[int] | None = None) -> tuple[RequestOutput, RequestOutput]:
    """The prompt prefix + tail on `cached` after its prefix was served (a hit of the prefix's whole
    blocks; with `beside`, another request decodes in the same steps), and on `fresh` (a miss)."""
    cached, fresh = engines
    cached.generate([prefix + [13]], SamplingParams(max_tokens=1, temperature=0.0))
    if beside is None:
        hit = cached.generate([prefix + tail], GREEDY)[0]
    else:
        # Its prompt, then one decode in the step of the hit's tail; then the hit decodes alone (decodes
        # batched with others are the deterministic mode's matter, not the cache's).
        cached.add_request(beside, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        cached.step()
        request = cached.add_request(prefix + tail, GREEDY)
        finished = [o for _ in range(40) if cached.has_unfinished_requests() for o in cached.step()
                    if o.finished and o.request_id == request]
        hit = finished[0]
    miss = fresh.generate([prefix + tail], GREEDY)[0]
    assert hit.metrics.num_cached_tokens == BLOCK * (len(prefix) // BLOCK) > 0
    assert miss.metrics.num_cached_tokens == 0
    return hit, miss


def _logprobs(out: RequestOutput) -> list[tuple[int, dict[int, float]]]:
    assert out.logprobs is not None
    return [(lp.token_id, lp.top) for lp in out.logprobs]


def _engines(bundled: ModelBundle, **config: object) -> tuple[Engine, Engine]:
    return bundled.engine(**config), bundled.engine(enable_prefix_caching=False, **config)


@pytest.mark.parametrize(("blocks", "tail"), [(1, 1), (2, 3), (3, 7), (5, 12), (8, 40)])
def test_a_prompt_chunk_over_a_cached_prefix_is_the_miss_bit_for_bit(bundled: ModelBundle, blocks: int,
                                                                      tail: int) -> None:
    # fp32 (the session's bundled model is unquantized). Tails of 1-3, 5-7 and 9-11 rows are where fp32
    # GEMMs take other kernels than for longer calls; a 1-token tail is a span shaped like a decode.
    document = _document(bundled)
    prefix, rest = document[: blocks * BLOCK], document[blocks * BLOCK : blocks * BLOCK + tail]
    hit, miss = _hit_and_miss(_engines(bundled), prefix, rest)
    assert _logprobs(hit) == _logprobs(miss)


def test_a_hit_beside_a_decode_and_a_chunked_miss_are_the_miss(bundled: ModelBundle) -> None:
    # The hit's tail shares its step with another request's decode (the projections split its prompt
    # rows off); the miss is prefilled in chunks of 32 tokens against one chunk.
    document = _document(bundled)
    prefix, rest = document[:48], document[48:60]
    hit, miss = _hit_and_miss(_engines(bundled), prefix, rest, beside=document[100:110])
    chunked = bundled.engine(enable_prefix_caching=False, max_num_batched_tokens=32).generate([prefix + rest], GREEDY)[0]
    assert _logprobs(hit) == _logprobs(miss) == _logprobs(chunked)


def test_a_speculative_verify_over_a_cached_prefix_is_the_miss(bundled: ModelBundle) -> None:
    # n-gram drafts over a repetitive document: the hit's verifies read the cached prefix from the pool.
    spec = SpeculativeConfig(method="ngram", num_tokens=4, draft_row_cost=0.0)
    document = _document(bundled)
    hit, miss = _hit_and_miss(_engines(bundled, speculative=spec), document[:64], document[64:70])
    plain = bundled.engine(enable_prefix_caching=False).generate([document[:70]], GREEDY)[0]
    assert hit.token_ids == miss.token_ids == plain.token_ids
    assert _logprobs(hit) == _logprobs(miss)


def test_a_hit_over_int8_kv_rows_is_the_miss_bit_for_bit(bundled: ModelBundle) -> None:
    document = _document(bundled)
    hit, miss = _hit_and_miss(_engines(bundled, kv_cache_dtype="int8"), document[:32], document[32:37])
    assert _logprobs(hit) == _logprobs(miss)


@pytest.fixture(scope="module")
def default_precision(bundled_gguf_path: Path, bundled: ModelBundle) -> ModelBundle:
    """The engine's default: the file's int4 codes, activations (and KV rows) as this machine chooses."""
    native = load_model(bundled_gguf_path, dtype=torch.float32, native_int4=True)
    return ModelBundle(build_model(native.config, native.weights, EngineConfig(), int4=native.int4), bundled.tokenizer)


def test_the_default_precision_hit_is_the_miss(default_precision: ModelBundle) -> None:
    # int4 weights, bf16 activations where the CPU has them (else fp32 with int8 KV rows): the reported
    # case, where the hit's short tail took other kernels than the miss's one chunk.
    document = _document(default_precision)
    engines = _engines(default_precision)
    for blocks, tail in ((2, 4), (4, 9)):
        prefix = document[: blocks * BLOCK]
        hit, miss = _hit_and_miss(engines, prefix, document[blocks * BLOCK : blocks * BLOCK + tail])
        assert _logprobs(hit) == _logprobs(miss)
