"""Speculative decoding on tiny random models: greedy identity, rollback bookkeeping, mixed batches,
the off-switch, adaptive k and the counters."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch

from decodeservice.engine import (
    ConfigError,
    Engine,
    EngineConfig,
    ModelConfig,
    SamplingParams,
    SpeculativeConfig,
)
from decodeservice.engine.loader.gguf_loader import read_gguf_tokenizer
from decodeservice.engine.loader.registry import resolve_model_path
from decodeservice.engine.model import LlamaModel
from decodeservice.engine.plan.planner import verify_row_cost
from decodeservice.engine.spec_decode.policy import PESSIMISTIC_ACCEPTANCE, request_prior
from decodeservice.engine.spec_decode.proposers import DraftModelProposer, ngram_lookup
from decodeservice.engine.tokenizer import Tokenizer

TINY = ModelConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                   num_kv_heads=2, head_dim=16, max_position_embeddings=512)
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
# Periodic, copy-like and plain prompts (token ids), so n-gram lookup both hits and misses.
PROMPTS: list[list[int]] = [[5, 6, 7, 8, 9] * 3, list(range(100, 140)), [300, 301, 302, 303] * 8 + [300],
                            [7, 1000, 2000, 7, 1000]]


def tiny_model(seed: int, *, std: float = 0.5, base: LlamaModel | None = None) -> LlamaModel:
    """Random weights scaled so the next token depends on context (with unit-variance embeddings
    tied to the head, a random model only ever repeats its input). With `base`, a noisy copy of it:
    a draft that agrees with the target often, but not always. `base` must be unpacked: an engine
    packs its model's projections for oneDNN and drops their plain weights."""
    torch.manual_seed(seed)
    model = LlamaModel(TINY)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                continue
            noise = torch.randn_like(param) * std / param.shape[-1] ** 0.5
            param.copy_(noise if base is None else base.get_parameter(name) + noise)
    return model.eval()


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return read_gguf_tokenizer(resolve_model_path("smollm2-135m"))


def target_model() -> LlamaModel:
    return tiny_model(0, std=1.0)


@pytest.fixture(scope="module")
def target() -> LlamaModel:
    return target_model()


def make_engine(target: LlamaModel, tokenizer: Tokenizer, spec: dict[str, Any] | None = None, *,
                draft: LlamaModel | None = None, **config: Any) -> Engine:
    config.setdefault("num_gpu_blocks_override", 96)
    if spec is not None:
        # The k and pause expectations below are written for 0.04 (by default the engine measures its
        # own, test_an_unset_row_cost_is_measured_at_start_up_and_used).
        spec = {"draft_row_cost": 0.04, **spec}
    return Engine(model=target, tokenizer=tokenizer, draft=draft,
                  config=EngineConfig(speculative=SpeculativeConfig.parse(spec), **config))


METHODS = [
    pytest.param({"method": "ngram", "num_tokens": 4}, id="ngram"),
    pytest.param({"method": "draft", "draft_model": "noisy-copy", "num_tokens": 3}, id="draft"),
    pytest.param({"method": "self_draft", "draft_layers": 3, "num_tokens": 5}, id="self_draft"),
]


# int8: the target's pool holds int8 rows (attention/kv_int8.py), which a verify reads as a dequantized
# copy and a decode in place; a draft's pool keeps the activations' dtype.
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
@pytest.mark.parametrize("spec", METHODS)
def test_greedy_output_is_identical_with_speculation(spec: dict[str, Any], kv_cache_dtype: str, target: LlamaModel,
                                                     tokenizer: Tokenizer) -> None:
    baseline = make_engine(target, tokenizer, kv_cache_dtype=kv_cache_dtype).generate(PROMPTS, GREEDY)
    draft = tiny_model(1, std=0.1, base=target_model()) if spec["method"] == "draft" else None
    # Every stream drafts every step (a row cost of 0): this checks verification and rollback, not when to
    # draft. (Priced, the four requests came together and nothing waits: the batch ends with its longest
    # stream, and the copy-free prompts' streams cannot draft, so no draft could shorten it.)
    engine = make_engine(target, tokenizer, {**spec, "draft_row_cost": 0.0}, draft=draft, kv_cache_dtype=kv_cache_dtype)
    outputs = engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in baseline]
    stats = engine.stats().spec_decode
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0  # it really speculated
    assert stats.num_accepted_tokens < stats.num_draft_tokens  # and really rolled back


def block_owners(engine: Engine) -> Counter[int]:
    owners: Counter[int] = Counter()
    for seq in engine.scheduler.running:
        owners.update(seq.block_ids)
    return owners


@pytest.mark.parametrize("spec", METHODS)
def test_allocator_is_consistent_after_rollbacks(spec: dict[str, Any], target: LlamaModel,
                                                 tokenizer: Tokenizer) -> None:
    draft = tiny_model(1, std=0.1, base=target_model()) if spec["method"] == "draft" else None
    # A small pool with prefix caching, so rollback, block sharing and preemption all happen.
    engine = make_engine(target, tokenizer, spec, draft=draft, num_gpu_blocks_override=40, block_size=4,
                         max_model_len=128)
    for prompt in PROMPTS * 2:
        engine.add_request(prompt, GREEDY)
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        assert steps < 2000
        kv = engine.kv
        owners = block_owners(engine)
        for block in kv.blocks:
            # Every block's reference count is exactly the number of live sequences holding it...
            assert block.ref_count == owners[block.block_id], f"block {block.block_id}"
            # ...and a block is in the free queue exactly when nobody holds it.
            assert (block.block_id in kv._free) == (block.ref_count == 0)
        for seq in engine.scheduler.running:
            assert len(seq.block_ids) == len(set(seq.block_ids))
            # Rejected slots were given back: blocks cover exactly the computed tokens.
            assert len(seq.block_ids) == kv.blocks_needed(seq.num_computed_tokens)
        proposer = engine.spec.proposer if engine.spec is not None else None
        if isinstance(proposer, DraftModelProposer):
            held = [b for blocks in proposer.owned_blocks().values() for b in blocks]
            assert len(held) == len(set(held)), "a draft block is owned twice"
            assert len(held) + proposer.num_free_blocks == engine.kv.num_blocks, "a draft block leaked"
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    if engine.spec is not None and isinstance(engine.spec.proposer, DraftModelProposer):
        assert engine.spec.proposer.num_free_blocks == engine.kv.num_blocks
    assert engine.stats().spec_decode.num_drafts > 0


def test_mixed_batch_gives_each_sequence_its_solo_output(target: LlamaModel, tokenizer: Tokenizer) -> None:
    # A draft model drafts at every decode step, so speculating and non-speculating sequences meet.
    spec = {"method": "draft", "draft_model": "noisy-copy", "num_tokens": 3}
    draft = tiny_model(1, std=0.1, base=target_model())
    solo = [make_engine(target, tokenizer, spec, draft=draft).generate([p], GREEDY)[0].token_ids for p in PROMPTS]
    # Prompts admitted mid-way are prefilled (no drafts) in the same steps the others verify drafts.
    engine = make_engine(target, tokenizer, spec, draft=draft)
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS[:2]]
    engine.step()
    engine.step()
    ids += [engine.add_request(p, GREEDY) for p in PROMPTS[2:]]
    done: dict[str, list[int]] = {}
    saw_mixed = False
    while engine.has_unfinished_requests():
        running = engine.scheduler.running
        # Someone in this step cannot speculate: about to be admitted, or still prefilling.
        plain = bool(engine.scheduler.waiting) or any(s.in_prefill for s in running)
        drafts_before = engine.stats().spec_decode.num_drafts
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        saw_mixed |= plain and engine.stats().spec_decode.num_drafts > drafts_before
    assert [done[i] for i in ids] == solo
    assert saw_mixed


def test_off_switch_and_adaptive_k(target: LlamaModel, tokenizer: Tokenizer) -> None:
    spec = {"method": "ngram", "num_tokens": 4, "disable_batch_size": 3}
    engine = make_engine(target, tokenizer, spec)
    for prompt in PROMPTS[:3]:
        engine.add_request(prompt, GREEDY)
    while engine.has_unfinished_requests():
        before = len(engine.scheduler.running)
        engine.step()
        if before >= 3:
            assert engine.stats().spec_decode.num_drafts == 0  # three running: nobody drafts
    big = engine.stats().spec_decode
    assert big.num_drafts == 0
    engine.generate(PROMPTS[:1], GREEDY)  # one stream, below the switch: its copy-like prompt drafts
    stats = engine.stats().spec_decode
    assert stats.num_drafts > 0
    assert sum(stats.accepted_per_position) == stats.num_accepted_tokens
    assert list(stats.accepted_per_position) == sorted(stats.accepted_per_position, reverse=True)
    # Adaptive k: a request whose drafts keep failing shrinks k to 1; one whose drafts all land grows to k.
    for draft, shrinks in ((tiny_model(5, std=8.0), True), (target, False)):
        engine = make_engine(target, tokenizer, {"method": "draft", "draft_model": "x", "num_tokens": 4},
                             draft=draft)
        engine.add_request(PROMPTS[1], GREEDY)
        seen_k: list[int] = []
        steps = 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
            seen_k += [s.spec_num_tokens for s in engine.scheduler.running if s.spec_num_tokens]  # 0: not yet
        stats = engine.stats().spec_decode
        assert stats.num_drafts > 0
        if shrinks:
            assert 1 in seen_k and stats.num_draft_tokens < 4 * stats.num_drafts
            assert stats.num_drafts < (steps - 1) / 2  # drafts that keep failing pause, then probe
        else:
            # a newcomer with nothing checked yet starts low (the pessimistic prior), then its own landed
            # drafts take it to k and keep it there
            assert seen_k[0] < 4 and set(seen_k[2:]) == {4} and stats.num_accepted_tokens == stats.num_draft_tokens


def test_a_new_request_starts_from_the_workloads_acceptance(target: LlamaModel, tokenizer: Tokenizer) -> None:
    # Before any draft was checked: the pessimistic prior. After: the engine's recent acceptance, pulled to it.
    assert request_prior(0.0, 0.0).mean == pytest.approx(PESSIMISTIC_ACCEPTANCE)
    assert PESSIMISTIC_ACCEPTANCE < request_prior(0.9, 50.0).mean < 0.9
    for draft, first_k in ((tiny_model(5, std=8.0), 1), (target, 4)):
        engine = make_engine(target, tokenizer, {"method": "draft", "draft_model": "x", "num_tokens": 4},
                             draft=draft)
        engine.generate([PROMPTS[1]], GREEDY)  # the workload so far: drafts that fail, or that all land
        engine.add_request(PROMPTS[2], GREEDY)
        seen_k: list[int] = []
        while engine.has_unfinished_requests():
            engine.step()
            seen_k += [s.spec_num_tokens for s in engine.scheduler.running if s.spec_num_tokens]
        # Failing drafts: the newcomer pauses first, then probes with one draft instead of opening with 4.
        assert seen_k[0] == first_k


def test_ngram_lookup() -> None:
    assert ngram_lookup([1, 2, 3, 4, 1, 2], n_min=1, n_max=3, k=2) == [3, 4]
    assert ngram_lookup([1, 2, 3, 9, 2, 3], n_min=1, n_max=3, k=3) == [9, 2, 3]
    assert ngram_lookup([1, 2, 3], n_min=1, n_max=3, k=2) == []
    # Longest match wins: "8 2" occurs once, "2" alone later, followed by something else.
    assert ngram_lookup([8, 2, 5, 6, 2, 7, 8, 2], n_min=1, n_max=2, k=2) == [5, 6]
    # A periodic tail still yields k tokens.
    assert ngram_lookup([4, 4, 4, 4, 4], n_min=1, n_max=2, k=3) == [4, 4, 4]
    assert ngram_lookup([1, 2], n_min=2, n_max=2, k=2) == []


def test_bad_configurations_are_rejected(target: LlamaModel, tokenizer: Tokenizer) -> None:
    with pytest.raises(ConfigError, match="draft_layers"):
        make_engine(target, tokenizer, {"method": "self_draft", "draft_layers": 4})
    with pytest.raises(ConfigError, match="needs a draft model"):
        make_engine(target, tokenizer, {"method": "draft", "draft_model": "x"})
    with pytest.raises(ConfigError, match="unknown speculative method"):
        SpeculativeConfig.parse({"method": "medusa"})
    with pytest.raises(ConfigError, match="bad speculative config"):
        SpeculativeConfig.parse({"method": "ngram", "k": 3})
    assert SpeculativeConfig.parse({"method": None}) is None


def test_an_unset_row_cost_is_measured_at_start_up_and_used(target: LlamaModel, tokenizer: Tokenizer,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="decodeservice.engine.engine"):
        measured = Engine(model=target, tokenizer=tokenizer, config=EngineConfig(
            num_gpu_blocks_override=96, speculative=SpeculativeConfig(method="ngram", num_tokens=4)))
    lines = [r.getMessage() for r in caplog.records if "draft row costs" in r.getMessage()]
    assert measured.spec is not None and len(lines) == 1
    assert f"costs {measured.spec.row_cost:.3f} of a decode step" in lines[0] and "4 drafts" in lines[0]
    assert 0.0 <= measured.spec.row_cost < 1.0
    cost = verify_row_cost(measured.runner, drafts=4, rounds=2)
    assert cost.plain_ms > 0 and cost.verify_ms > 0
    assert cost.row_cost == pytest.approx(min(max(cost.verify_ms - cost.plain_ms, 0) / (4 * cost.plain_ms), 0.99))
    caplog.clear()
    with caplog.at_level("INFO", logger="decodeservice.engine.engine"):
        configured = make_engine(target, tokenizer, {"method": "ngram", "num_tokens": 4, "draft_row_cost": 0.3})
    assert configured.spec is not None and configured.spec.row_cost == 0.3
    assert not [r for r in caplog.records if "draft row costs" in r.getMessage()]  # nothing measured
    # the measurement's K/V left no trace: the engine serves the same greedy text as one without speculation
    plain = make_engine(target, tokenizer).generate(PROMPTS[:2], GREEDY)
    assert [o.token_ids for o in measured.generate(PROMPTS[:2], GREEDY)] == [o.token_ids for o in plain]
