"""Flex attention over the paged pool (eager on CPU) equals full recompute; its block mask covers the mask.

test_backends.py checks the backend on random K/V against dense masked attention; these go through
the runner and the engine on a tiny random model, as tests/engine/test_paged_attention.py does for
the CPU backend, with the same scenarios."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask

from decodeservice.engine import SamplingParams
from decodeservice.engine.attention import (
    AttentionMetadata,
    SequenceSpan,
    StepAttention,
    attend,
    backend_for,
    slot_runs,
)
from decodeservice.engine.attention.flex import Q_TILE, FlexPagedBackend, PageMap
from decodeservice.engine.attention.gather import GatherBackend
from decodeservice.engine.errors import ConfigError
from decodeservice.engine.kv_cache import cdiv
from decodeservice.engine.runner import ModelRunner
from tests.conftest import ModelBundle
from tests.engine.attention.test_backends import BS, NUM_BLOCKS, SEQUENCES, build_step
from tests.engine.test_paged_attention import PROMPTS, chunk_then_verify, dense_logprobs

CPU = torch.device("cpu")


def page_indices_cover(block_mask: BlockMask, page_map: PageMap, batch: int, max_new: int) -> bool:
    """Whether every (query, slot) pair mask_mod allows lies on a page the sparse indices visit."""
    slots = page_map.num_blocks * page_map.block_size
    b, q, kv = torch.meshgrid(torch.arange(batch), torch.arange(max_new), torch.arange(slots), indexing="ij")
    allowed = page_map.mask_mod(b, torch.zeros_like(b), q, kv)  # (B, Qmax, slots)
    visited = torch.zeros(batch, cdiv(max_new, Q_TILE), page_map.num_blocks, dtype=torch.bool)
    counts, indices = block_mask.kv_num_blocks[:, 0].cpu(), block_mask.kv_indices[:, 0].cpu()
    for i in range(batch):
        for j in range(counts.shape[1]):
            visited[i, j, indices[i, j, : int(counts[i, j])].long()] = True
    tile_of_query = torch.arange(max_new) // Q_TILE
    page_of_slot = torch.arange(slots) // page_map.block_size
    on_visited = visited[:, tile_of_query][:, :, page_of_slot]  # (B, Qmax, slots)
    return bool((on_visited | ~allowed).all())


def test_flex_runner_equals_dense_over_scattered_blocks_with_unequal_drafts(tiny: ModelBundle) -> None:
    # Three sequences in every step, block tables in shuffled pool order: a 9-token prompt chunk, the
    # rest of each prompt over that cached prefix, then two verifies with unequal drafts beside a decode.
    backend = FlexPagedBackend(num_blocks=64, block_size=4, device=CPU)
    runner = ModelRunner(tiny.model, num_blocks=64, block_size=4, device=CPU, dtype=torch.float32,
                         attention_backend=backend)
    pool = torch.randperm(64, generator=torch.Generator().manual_seed(3)).tolist()
    prompts = [list(range(100, 131)), list(range(500, 519)), list(range(900, 911))]
    seqs, checks = chunk_then_verify(runner, pool, prompts)
    assert any(len(slot_runs(s.block_ids, num_tokens=len(s.block_ids) * 4, block_size=4)) > 1 for s in seqs)
    assert backend.generation == 3, "one plan per step"
    for tokens, first, rows in checks:
        assert rows is not None
        reference = dense_logprobs(tiny, tokens)[first : first + rows.shape[0]]
        assert (torch.log_softmax(rows, dim=-1) - reference).abs().max() < 1e-4


def test_flex_engine_chunked_prefill_batched_decode_and_prefix_hit_equal_dense(tiny: ModelBundle) -> None:
    # Through the engine: a 24-token budget chunks the prompts and mixes chunks with decodes of the
    # others in one step; then a prompt sharing two full blocks with the first hits the prefix cache.
    engine = tiny.engine(block_size=16, max_num_batched_tokens=24, max_model_len=256, num_gpu_blocks_override=64)
    engine.runner.attention_backend = FlexPagedBackend(num_blocks=64, block_size=16, device=CPU)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = engine.generate(PROMPTS[:1] + PROMPTS[2:], params)
    outs.append(engine.generate([PROMPTS[1]], params)[0])
    assert outs[-1].metrics.num_cached_tokens == 32
    for prompt, out in zip(PROMPTS[:1] + PROMPTS[2:] + PROMPTS[1:2], outs, strict=True):
        reference = dense_logprobs(tiny, prompt + out.token_ids)
        assert out.logprobs is not None
        for i, token in enumerate(out.token_ids):
            row = reference[len(prompt) - 1 + i]
            assert token == int(row.argmax()), f"token {i} differs from full recompute"
            assert math.isclose(out.logprobs[i].logprob, float(row[token]), abs_tol=1e-4)


@pytest.mark.parametrize("chunk", [0, 300], ids=["test_backends_step", "long_chunk"])
def test_block_mask_pages_cover_every_visible_key(chunk: int) -> None:
    # Eager flex reads every slot and lets mask_mod decide, so the tests above cannot see a page
    # missing from the sparse indices the GPU kernel visits: checked here, pair by pair. The long
    # chunk spans three query tiles, whose visible pages grow with the causal limit.
    backend = FlexPagedBackend(num_blocks=NUM_BLOCKS, block_size=BS, device=CPU)
    step, *_ = build_step(torch.float32, backend)
    meta = step.meta
    if chunk:
        # One sequence: a 300-token prompt chunk over 20 cached keys.
        blocks = list(range(100, 100 + -(-320 // BS)))
        meta = AttentionMetadata(slot_mapping=torch.zeros(chunk, dtype=torch.long), block_size=BS, spans=(SequenceSpan(
            token_start=0, num_new=chunk, context_len=320, runs=slot_runs(blocks, num_tokens=320, block_size=BS),
            block_table=torch.tensor(blocks)),))
    planned = backend.plan(meta, dtype=torch.float32)
    mask = planned.block_mask
    assert page_indices_cover(mask, backend.page_map, len(planned.spans), planned.max_new)
    if chunk:
        visible = mask.kv_num_blocks[0, 0].tolist()
        assert len(visible) == -(-chunk // Q_TILE) and visible == sorted(visible) and visible[0] < visible[-1] == 80
    # Dropping a sequence's last page from its indices must be caught.
    mask.kv_num_blocks[-1, 0, -1] -= 1
    assert not page_indices_cover(mask, backend.page_map, len(planned.spans), planned.max_new)


def test_stale_plan_is_refused() -> None:
    # The page map is rewritten in place by every plan(); a step planned before another must not read it.
    backend = FlexPagedBackend(num_blocks=NUM_BLOCKS, block_size=BS, device=CPU)
    step, q, k, v, k_cache, v_cache, _ = build_step(torch.float32, backend)
    first = backend.plan(step.meta, dtype=torch.float32)
    backend.plan(step.meta, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="earlier plan"):
        attend(q, k, v, k_cache, v_cache, StepAttention(meta=first, backend=backend))


def test_page_map_grows_past_its_capacity() -> None:
    backend = FlexPagedBackend(num_blocks=NUM_BLOCKS, block_size=BS, device=CPU)
    assert backend.page_map.capacity < len(SEQUENCES)
    step, q, k, v, k_cache, v_cache, reference = build_step(torch.float32, backend, seed=2)
    out = attend(q, k, v, k_cache, v_cache, StepAttention(meta=backend.plan(step.meta, dtype=torch.float32),
                                                          backend=backend))
    assert backend.page_map.capacity >= len(SEQUENCES)
    torch.testing.assert_close(out.double(), reference, atol=1e-5, rtol=0)


def test_backend_choice_and_cuda_block_size() -> None:
    assert backend_for(CPU, num_blocks=8).name == "paged_views"
    # CUDA without a pool size, or with pages below the Triton tile, keeps the portable backend
    # (choosing costs no device memory, so this runs without a GPU).
    assert isinstance(backend_for(torch.device("cuda")), GatherBackend)
    assert isinstance(backend_for(torch.device("cuda"), num_blocks=8, block_size=8), GatherBackend)
    with pytest.raises(ConfigError, match="block_size >= 16"):
        FlexPagedBackend(num_blocks=8, block_size=8, device=torch.device("cuda"))


def test_compiled_flex_is_not_recompiled_per_step() -> None:
    # The mask reads every per-step value from device tensors, so a compiled flex call is traced once
    # for steps of the same shape, whatever their page tables (a Python number of the step in the
    # mask, e.g. a length, retraces every step: checked by hand). Traced by dynamo on CPU with a
    # backend that counts graphs and runs them as they are.
    graphs: list[torch.fx.GraphModule] = []

    def counting(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable[..., Any]:
        graphs.append(gm)
        return gm.forward

    backend = FlexPagedBackend(num_blocks=NUM_BLOCKS, block_size=BS, device=CPU, compiled=True,
                               compile_backend=counting)
    for seed in range(3):
        step, q, k, v, k_cache, v_cache, reference = build_step(torch.float32, backend, seed)
        planned = StepAttention(meta=backend.plan(step.meta, dtype=torch.float32), backend=backend)
        torch.testing.assert_close(attend(q, k, v, k_cache, v_cache, planned).double(), reference, atol=1e-5, rtol=0)
    assert len(graphs) == 1
