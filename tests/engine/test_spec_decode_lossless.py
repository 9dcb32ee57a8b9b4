"""Rejection sampling is lossless: with speculation, sampled tokens follow the target's distribution.

Each check is a chi-square goodness-of-fit test at significance ALPHA = 0.001 (cells with an expected
count under 5 are pooled), against the exact distribution the non-speculative engine samples from.
Seeds are fixed, so the outcome is deterministic; each check is paired with a deliberately biased
sampler (a classic bug: resampling from p instead of norm(max(p - q, 0)) after a rejection) that the
same test must reject, so the test can fail.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable

import pytest
import torch

from decodeservice.engine import Engine, EngineConfig, ModelConfig, SamplingParams, SpeculativeConfig
from decodeservice.engine.loader.gguf_loader import read_gguf_tokenizer
from decodeservice.engine.loader.registry import resolve_model_path
from decodeservice.engine.model import LlamaModel
from decodeservice.engine.sampler import target_probs
from decodeservice.engine.spec_decode.decoder import SampledVerifier, SpeculativeDecoder
from decodeservice.engine.spec_decode.verify import (
    accept_probabilities,
    greedy_accept,
    rejection_sample,
)

ALPHA = 1e-3


def chi_square_pvalue(counts: Counter[int] | Counter[tuple[int, ...]], probs: dict[object, float]) -> float:
    """P-value of observed `counts` against exact `probs` (every outcome with probability > 0)."""
    n = sum(counts.values())
    assert set(counts) <= set(probs), f"impossible outcomes sampled: {set(counts) - set(probs)}"
    cells: list[tuple[float, float]] = []  # (observed, expected)
    pooled_obs = pooled_exp = 0.0
    for outcome, prob in probs.items():
        expected = n * prob
        if expected < 5:
            pooled_obs += counts.get(outcome, 0)  # type: ignore[call-overload]
            pooled_exp += expected
        else:
            cells.append((counts.get(outcome, 0), expected))  # type: ignore[call-overload]
    if pooled_exp > 0:
        cells.append((pooled_obs, pooled_exp))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    df = len(cells) - 1
    # Survival function of chi2(df): the regularized upper incomplete gamma Q(df/2, stat/2).
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def resample_from_p(draft_ids: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None,
                    generator: torch.Generator | None) -> list[int]:
    """Biased on purpose: after a rejection it samples p itself, not norm(max(p - q, 0))."""
    k = draft_ids.shape[0]
    accepted = torch.rand(k, generator=generator) < accept_probabilities(p, q, draft_ids)
    n = int(accepted.long().cumprod(0).sum())
    return [*draft_ids[:n].tolist(), int(torch.multinomial(p[n], 1, generator=generator))]


# -- the pure rule ---------------------------------------------------------------------------------
def test_greedy_accept() -> None:
    assert greedy_accept(torch.tensor([4, 5, 6]), torch.tensor([4, 5, 9, 1])) == [4, 5, 9]
    assert greedy_accept(torch.tensor([4, 5, 6]), torch.tensor([4, 5, 6, 1])) == [4, 5, 6, 1]
    assert greedy_accept(torch.tensor([4, 5, 6]), torch.tensor([7, 5, 6, 1])) == [7]


def first_token_counts(verifier: SampledVerifier, p: torch.Tensor, q: torch.Tensor | None, *,
                       fixed_draft: list[int] | None, trials: int) -> Counter[int]:
    generator = torch.Generator().manual_seed(1234)
    counts: Counter[int] = Counter()
    for _ in range(trials):
        if fixed_draft is not None:
            drafts = torch.tensor(fixed_draft)
        else:
            assert q is not None
            drafts = torch.multinomial(q, 1, generator=generator).squeeze(1)  # the draft samples from q
        counts[verifier(drafts, p, q, generator)[0]] += 1
    return counts


@pytest.mark.parametrize("deterministic", [False, True], ids=["draft-q", "one-hot-q"])
def test_rejection_sampling_matches_the_target(deterministic: bool) -> None:
    torch.manual_seed(0)
    vocab, k = 6, 2
    p = torch.softmax(torch.randn(k + 1, vocab) * 1.5, dim=-1)
    q = None if deterministic else torch.softmax(torch.randn(k, vocab) * 1.5, dim=-1)
    fixed = [int(p[0].argmin()), 1] if deterministic else None  # an unlikely n-gram guess
    exact = {t: float(p[0, t]) for t in range(vocab)}
    good = first_token_counts(rejection_sample, p, q, fixed_draft=fixed, trials=6000)
    assert chi_square_pvalue(good, exact) > ALPHA  # type: ignore[arg-type]
    biased = first_token_counts(resample_from_p, p, q, fixed_draft=fixed, trials=6000)
    assert chi_square_pvalue(biased, exact) < ALPHA  # type: ignore[arg-type]


# -- in the engine ---------------------------------------------------------------------------------
# A small vocabulary keeps the exact joint distribution cheap; token ids stay valid for the tokenizer.
TINY = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=8, max_position_embeddings=64)
PARAMS = {"temperature": 1.0, "top_k": 3, "max_tokens": 4, "ignore_eos": True}
PROMPT = [3, 14, 15, 9, 26, 5, 35, 8]
SAMPLES = 1500


def tiny_model(seed: int, *, base: LlamaModel | None = None, noise: float = 1.0) -> LlamaModel:
    torch.manual_seed(seed)
    model = LlamaModel(TINY)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                delta = torch.randn_like(param) * noise * 2 / param.shape[-1] ** 0.5
                param.copy_(delta if base is None else base.get_parameter(name) + delta)
    return model.eval()


def exact_joint(model: LlamaModel, params: SamplingParams) -> dict[object, float]:
    """P(t1..t4) for the target sampled token by token: the non-speculative engine's distribution."""
    probs: dict[object, float] = {}
    frontier: list[tuple[tuple[int, ...], float]] = [((), 1.0)]
    for _ in range(params.max_tokens):
        grown = []
        for prefix, mass in frontier:
            logits = model.forward_dense(torch.tensor(PROMPT + list(prefix)))[-1]
            dist = target_probs(logits, params)
            grown += [((*prefix, t), mass * float(dist[t])) for t in torch.nonzero(dist).flatten().tolist()]
        frontier = grown
    probs.update(frontier)
    return probs


def sample_joint(engine: Engine, params: SamplingParams) -> Counter[tuple[int, ...]]:
    seeded = [SamplingParams(seed=seed, **PARAMS) for seed in range(SAMPLES)]  # type: ignore[arg-type]
    assert all(p.top_k == params.top_k for p in seeded)
    return Counter(tuple(out.token_ids) for out in engine.generate([PROMPT] * SAMPLES, seeded))


@pytest.fixture(scope="module")
def setup() -> tuple[Engine, Callable[[SampledVerifier], Engine], dict[object, float]]:
    tokenizer = read_gguf_tokenizer(resolve_model_path("smollm2-135m"))
    target = tiny_model(0)
    draft = tiny_model(1, base=target, noise=0.3)  # agrees often, not always
    params = SamplingParams(**PARAMS)  # type: ignore[arg-type]
    # No break-even back-off: this test wants every request to draft, to exercise verification.
    spec = SpeculativeConfig(method="draft", draft_model="noisy-copy", num_tokens=2, disable_batch_size=10**6,
                             draft_row_cost=0.0)

    def build(verifier: SampledVerifier) -> Engine:
        engine = Engine(model=target, tokenizer=tokenizer, draft=draft, config=EngineConfig(
            speculative=spec, num_gpu_blocks_override=SAMPLES + 8, max_num_seqs=SAMPLES,
            enable_prefix_caching=False))
        assert engine.spec is not None
        # The same proposer, verified by the given rule.
        engine.spec = SpeculativeDecoder(spec, engine.spec.proposer, max_positions=TINY.max_position_embeddings,
                                         sampled_verifier=verifier)
        return engine

    return build(rejection_sample), build, exact_joint(target, params)


def test_speculative_sampling_is_lossless_in_the_engine(
        setup: tuple[Engine, Callable[[SampledVerifier], Engine], dict[object, float]]) -> None:
    engine, _, exact = setup
    counts = sample_joint(engine, SamplingParams(**PARAMS))  # type: ignore[arg-type]
    stats = engine.stats().spec_decode
    # Both paths ran many times: accepted drafts (some with bonus tokens) and rejections.
    assert stats.num_accepted_tokens > SAMPLES // 4
    assert stats.num_draft_tokens - stats.num_accepted_tokens > SAMPLES // 4
    assert len(exact) > 10 and sum(exact.values()) == pytest.approx(1.0)
    assert chi_square_pvalue(counts, exact) > ALPHA


def test_the_engine_check_catches_a_biased_sampler(
        setup: tuple[Engine, Callable[[SampledVerifier], Engine], dict[object, float]]) -> None:
    _, build, exact = setup
    counts = sample_joint(build(resample_from_p), SamplingParams(**PARAMS))  # type: ignore[arg-type]
    assert chi_square_pvalue(counts, exact) < ALPHA


def test_seeded_sampling_is_reproducible_with_speculation(
        setup: tuple[Engine, Callable[[SampledVerifier], Engine], dict[object, float]]) -> None:
    engine, _, _ = setup
    params = [SamplingParams(seed=s, temperature=1.0, top_k=5, max_tokens=12, ignore_eos=True) for s in (7, 8)]
    first = [o.token_ids for o in engine.generate([PROMPT, PROMPT], params)]
    # Alone, and beside other traffic: each seeded request gets the same tokens.
    assert [engine.generate([PROMPT], [params[0]])[0].token_ids] == first[:1]
    mixed = engine.generate([PROMPT, [1, 2, 3], PROMPT], [params[0], params[1], params[1]])
    assert [mixed[0].token_ids, mixed[2].token_ids] == first
    assert list(itertools.chain(*first))  # not empty
