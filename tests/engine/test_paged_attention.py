"""Paged decoding (block tables, prefix cache, chunked prefill, batching) equals full recompute."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from decodeservice.engine import SamplingParams
from decodeservice.engine.attention import slot_runs
from decodeservice.engine.attention.paged_views import PagedViewsBackend
from decodeservice.engine.runner import ModelRunner
from decodeservice.engine.scheduler import ScheduledSequence, SchedulerPlan
from decodeservice.engine.sequence import Sequence
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


DRAFTS = [[7, 8, 9], [], [11, 12, 13, 14, 15]]
Checks = list[tuple[list[int], int, torch.Tensor | None]]


def chunk_then_verify(runner: ModelRunner, pool: list[int], prompts: list[list[int]], *,
                      before_verify: Callable[[list[ScheduledSequence]], None] | None = None
                      ) -> tuple[list[Sequence], Checks]:
    """Three sequences with block tables taken in `pool` order: a 9-token prompt chunk, the rest of each
    prompt over that cached prefix (the middle one completes its prompt, so its chunk's last row is
    checked), then one step of verifies with DRAFTS (unequal, one empty: a plain decode).

    Returns the sequences and, per checked step, (tokens, first position, the runner's logit rows)."""
    seqs = []
    for i, (prompt, draft) in enumerate(zip(prompts, DRAFTS, strict=True)):
        seq = Sequence(request_id=f"s{i}", prompt_token_ids=prompt, params=SamplingParams())
        needed = -(-(len(prompt) + len(draft) + 1) // 4)
        seq.block_ids, pool = pool[:needed], pool[needed:]
        seqs.append(seq)

    def run(items: list[ScheduledSequence]) -> list[torch.Tensor | None]:
        rows = runner.execute(SchedulerPlan(scheduled=items)).rows
        for item in items:
            item.seq.num_computed_tokens += item.num_new_tokens - item.num_spec_tokens
        return rows

    run([ScheduledSequence(seq=s, num_new_tokens=9, num_spec_tokens=0) for s in seqs])
    rest = [len(s.prompt_token_ids) - 9 - (0 if i == 1 else 1) for i, s in enumerate(seqs)]
    chunk_rows = run([ScheduledSequence(seq=s, num_new_tokens=n, num_spec_tokens=0) for s, n in zip(seqs, rest, strict=True)])
    checks: Checks = [(prompts[1], len(prompts[1]) - 1, chunk_rows[1])]
    seqs[1].output_token_ids.append(42)
    for seq, draft in zip(seqs, DRAFTS, strict=True):
        seq.spec_token_ids = list(draft)
    verifies = [ScheduledSequence(seq=s, num_new_tokens=1 + len(d), num_spec_tokens=len(d))
                for s, d in zip(seqs, DRAFTS, strict=True)]
    if before_verify is not None:
        before_verify(verifies)
    for seq, draft, rows in zip(seqs, DRAFTS, run(verifies), strict=True):
        checks.append((seq.token_ids + draft, seq.num_tokens - 1, rows))
    return seqs, checks


def test_runner_equals_dense_over_scattered_blocks_with_unequal_drafts(tiny: ModelBundle) -> None:
    # Straight through the runner, with block tables in shuffled pool order (each table is several
    # runs): a prompt with nothing cached, a chunk over that cached prefix, then in one step two
    # verifies with different draft counts beside a plain decode.
    runner = ModelRunner(tiny.model, num_blocks=64, block_size=4, device=torch.device("cpu"), dtype=torch.float32)
    pool = torch.randperm(64, generator=torch.Generator().manual_seed(3)).tolist()
    prompts = [list(range(100, 131)), list(range(500, 519)), list(range(900, 911))]
    seqs, checks = chunk_then_verify(runner, pool, prompts)
    assert any(len(slot_runs(s.block_ids, num_tokens=len(s.block_ids) * 4, block_size=4)) > 1 for s in seqs)
    for tokens, first, rows in checks:
        assert rows is not None
        reference = dense_logprobs(tiny, tokens)[first : first + rows.shape[0]]
        assert (torch.log_softmax(rows, dim=-1) - reference).abs().max() < 1e-4


def test_bundled_shared_prefix_follow_up_hits_and_matches(bundled: ModelBundle) -> None:
    # A long document asked about once with a one-token answer, then again with a new question. The
    # first request's last prompt chunk must reach the prefix cache although it finished at once, and
    # the greedy answer must equal the one computed without any cache.
    document = "The committee reviewed the budget, the schedule and the staffing plan in detail. " * 40
    first, follow_up = document + "Is the plan approved?", document + "Who chairs the committee?"
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engine = bundled.engine(max_model_len=1024, num_gpu_blocks_override=160)
    engine.generate(first, SamplingParams(max_tokens=1, temperature=0.0))
    hit = engine.generate(follow_up, greedy)[0]
    shared = len(bundled.tokenizer.encode(document))
    assert shared > 512, "the document should span more than one prefill chunk"
    assert hit.metrics.num_cached_tokens >= 16 * (shared // 16 - 1)
    cold = bundled.engine(max_model_len=1024, num_gpu_blocks_override=160,
                          enable_prefix_caching=False).generate(follow_up, greedy)[0]
    assert cold.metrics.num_cached_tokens == 0
    assert hit.token_ids == cold.token_ids


# -- bf16, as the quantized engine runs attention ---------------------------------------------------
# bf16 keeps 8 significant bits, so paged and dense bf16 differ by rounding (summation order, where
# scores and probabilities are rounded). The tolerance is calibrated on the model itself: the dense
# bf16 recompute's distance from the fp32 recompute of the same weights (`noise`) is what bf16 costs
# over the whole network. The paged path changes only how attention is summed; this tiny random model
# has scores in the hundreds, where rounding weighs most, so the budget is twice the noise. A wrong
# mask, a missing key or a misplaced head moves logprobs by whole units.
BF16_BUDGET = 2.0


@pytest.fixture(scope="module")
def bf16_twins(tiny_factory: Callable[..., ModelBundle]) -> tuple[ModelBundle, ModelBundle]:
    """The same random weights in fp32 (the reference) and in bf16 (activations and KV cache)."""
    reference, bf16 = tiny_factory(seed=5), tiny_factory(seed=5)
    bf16.model.to(torch.bfloat16)
    assert bf16.model.activation_dtype == torch.bfloat16
    return reference, bf16


def assert_within_bf16_noise(reference: ModelBundle, bf16: ModelBundle, tokens: list[int], first: int,
                             rows: torch.Tensor) -> None:
    """rows (r, V): the paged bf16 logits of positions first .. first + r - 1 of `tokens`, compared on
    each row's most likely token (the far tail of a vocabulary moves most under rounding and says least)."""
    exact = dense_logprobs(reference, tokens)[first : first + rows.shape[0]]
    dense = dense_logprobs(bf16, tokens)[first : first + rows.shape[0]]
    top = exact.argmax(dim=-1, keepdim=True)
    paged = torch.log_softmax(rows.float(), dim=-1).gather(1, top)
    noise = float((dense.gather(1, top) - exact.gather(1, top)).abs().max())
    error = float((paged - dense.gather(1, top)).abs().max())
    assert noise > 0, "the twins should differ by bf16 rounding"
    assert error <= BF16_BUDGET * noise, f"paged bf16 is {error:.4f} from dense bf16, which is {noise:.4f} from fp32"


def test_bf16_runner_equals_dense_over_scattered_blocks_with_unequal_drafts(
        bf16_twins: tuple[ModelBundle, ModelBundle]) -> None:
    # As test_runner_equals_dense_over_scattered_blocks_with_unequal_drafts, in bf16, on the plain path.
    reference, bf16 = bf16_twins
    backend = PagedViewsBackend()
    runner = ModelRunner(bf16.model, num_blocks=200, block_size=4, device=torch.device("cpu"),
                         dtype=torch.bfloat16, attention_backend=backend)
    for k_cache, v_cache in runner.kv_caches:  # stale, finite values where no sequence wrote: never read
        k_cache.normal_(0, 30)
        v_cache.normal_(0, 30)
    pool = torch.randperm(200, generator=torch.Generator().manual_seed(4)).tolist()
    # Long contexts, read in place by both backends.
    prompts = [list(range(100, 400)), list(range(500, 519)), list(range(900, 1170))]

    _, checks = chunk_then_verify(runner, pool, prompts)
    for tokens, first, rows in checks:
        assert rows is not None
        assert_within_bf16_noise(reference, bf16, tokens, first, rows)


def test_bf16_engine_decode_and_prefix_hit_equal_dense(bf16_twins: tuple[ModelBundle, ModelBundle]) -> None:
    # Through the engine in bf16: chunked prefill over a cached prefix (24-token budget), batched
    # decodes, a prefix-cache hit, as its plan reads the pool.
    reference, bf16 = bf16_twins
    engine = bf16.engine(block_size=16, max_num_batched_tokens=96, max_model_len=512, num_gpu_blocks_override=96)
    assert engine.runner.kv_caches[0][0].dtype == torch.bfloat16
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
    # Long contexts, read in place by both backends.
    document = list(range(1000, 1270))
    engine.generate([document + [5, 6]], params)
    prompts = [PROMPTS[0], document + list(range(300, 320)), list(range(2000, 2290))]  # the second hits
    outs = engine.generate(prompts, params)
    assert outs[1].metrics.num_cached_tokens == 16 * (len(document) // 16)
    noise, error = 0.0, 0.0
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.logprobs is not None
        tokens = prompt + out.token_ids
        rows = torch.arange(len(prompt) - 1, len(tokens) - 1)
        chosen = torch.tensor(out.token_ids)
        dense = dense_logprobs(bf16, tokens)[rows, chosen]
        noise = max(noise, float((dense - dense_logprobs(reference, tokens)[rows, chosen]).abs().max()))
        error = max(error, float((torch.tensor([lp.logprob for lp in out.logprobs]) - dense).abs().max()))
    assert noise > 0, "the twins should differ by bf16 rounding"
    assert error <= BF16_BUDGET * noise, f"paged bf16 is {error:.4f} from dense bf16, which is {noise:.4f} from fp32"
