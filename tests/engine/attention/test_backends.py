"""Every attention backend equals dense masked attention, over scattered and contiguous pool blocks."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from decodeservice.engine.attention import (
    AttentionBackend,
    AttentionMetadata,
    SequenceSpan,
    SlotRun,
    StepAttention,
    attend,
    backend_for,
    slot_runs,
)
from decodeservice.engine.attention.flex import FlexPagedBackend
from decodeservice.engine.attention.gather import GatherBackend
from decodeservice.engine.attention.metadata import trim_runs
from decodeservice.engine.attention.paged_views import PagedViewsBackend

H, HKV, D, BS, NUM_BLOCKS = 6, 2, 8, 4, 200

# (new tokens Q, context L, contiguous blocks?): decode, a prompt chunk over a cached prefix,
# verifies with unequal drafts, a prompt with nothing cached, a decode over one run, and a verify and
# a decode over longer contexts.
SEQUENCES = [(1, 13, False), (9, 23, False), (3, 10, False), (6, 30, True), (7, 7, False), (1, 16, True),
             (4, 21, False), (5, 290, False), (1, 260, False)]


def test_slot_runs_split_where_blocks_jump() -> None:
    assert slot_runs([7, 8, 9, 3, 4], num_tokens=18, block_size=4) == (
        SlotRun(first_slot=28, length=12), SlotRun(first_slot=12, length=6))
    assert slot_runs([5], num_tokens=1, block_size=4) == (SlotRun(first_slot=20, length=1),)
    assert trim_runs(slot_runs([7, 8, 9, 3, 4], num_tokens=18, block_size=4), 13) == [
        SlotRun(first_slot=28, length=12), SlotRun(first_slot=12, length=1)]


def build_step(dtype: torch.dtype, backend: AttentionBackend, seed: int = 0, *, block_size: int = BS,
               head_dim: int = D
               ) -> tuple[StepAttention, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A step over SEQUENCES with random K/V already in the pool, and the dense reference output."""
    gen = torch.Generator().manual_seed(seed)
    # Slots no sequence wrote hold stale, finite values (a block's previous owner): never to be read.
    k_cache = (torch.randn(NUM_BLOCKS, block_size, HKV, head_dim, generator=gen) * 30).to(dtype)
    v_cache = (torch.randn(NUM_BLOCKS, block_size, HKV, head_dim, generator=gen) * 30).to(dtype)
    top = NUM_BLOCKS  # contiguous tables come from the top of the pool, scattered ones from the rest
    free = torch.randperm(NUM_BLOCKS - 12, generator=gen).tolist()
    spans, slots, qs, ks, vs, refs = [], [], [], [], [], []
    start = 0
    for num_new, length, contiguous in SEQUENCES:
        n_blocks = -(-length // block_size)
        if contiguous:
            top -= n_blocks
            blocks = list(range(top, top + n_blocks))
        else:
            blocks, free = free[:n_blocks], free[n_blocks:]
        keys = torch.randn(length, HKV, head_dim, generator=gen).to(dtype)
        values = torch.randn(length, HKV, head_dim, generator=gen).to(dtype)
        seq_slots = [blocks[p // block_size] * block_size + p % block_size for p in range(length)]
        cached = length - num_new
        k_cache.view(-1, HKV, head_dim)[seq_slots[:cached]] = keys[:cached]  # what earlier steps wrote
        v_cache.view(-1, HKV, head_dim)[seq_slots[:cached]] = values[:cached]
        q = torch.randn(num_new, H, head_dim, generator=gen).to(dtype)
        visible = torch.arange(length).unsqueeze(0) <= (torch.arange(num_new) + cached).unsqueeze(1)  # (Q, L)
        ref = F.scaled_dot_product_attention(
            q.double().transpose(0, 1), keys.double().transpose(0, 1), values.double().transpose(0, 1),
            attn_mask=visible, enable_gqa=True).transpose(0, 1)  # (Q, H, D)
        spans.append(SequenceSpan(token_start=start, num_new=num_new, context_len=length,
                                  runs=slot_runs(blocks, num_tokens=length, block_size=block_size),
                                  block_table=torch.tensor(blocks)))
        slots.extend(seq_slots[cached:])
        qs.append(q)
        ks.append(keys[cached:])
        vs.append(values[cached:])
        refs.append(ref)
        start += num_new
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots), spans=tuple(spans), block_size=block_size)
    return (StepAttention(meta=meta, backend=backend), torch.cat(qs), torch.cat(ks), torch.cat(vs),
            k_cache, v_cache, torch.cat(refs))


@pytest.mark.parametrize("backend", [PagedViewsBackend(), GatherBackend(), FlexPagedBackend(
    num_blocks=NUM_BLOCKS, block_size=BS, device=torch.device("cpu"))], ids=lambda b: b.name)
@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)],
                         ids=["fp32", "bf16"])
@pytest.mark.parametrize("planned", [True, False], ids=["planned", "per_sequence"])
def test_backend_equals_dense_reference(backend: AttentionBackend, dtype: torch.dtype, atol: float,
                                        planned: bool) -> None:
    # Planned or not, the CPU backend without its native kernel takes the plain path for every sequence.
    # Flex (eager here) plans in attend() when it was not planned.
    step, q, k, v, k_cache, v_cache, reference = build_step(dtype, backend)
    if planned:
        step = StepAttention(meta=backend.plan(step.meta, dtype=dtype), backend=backend)
    out = attend(q, k, v, k_cache, v_cache, step)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.double(), reference, atol=atol, rtol=0)
    runs = [len(s.runs) for s in step.meta.spans]
    # Covered: tables in one run of slots, a few runs, and scattered over many.
    assert 1 in runs and any(1 < r <= 4 for r in runs) and any(r > 4 for r in runs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: the GPU path (gather backend, "
                    "fused lower-right causal SDPA) is only exercised where one exists")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gather_on_cuda_equals_dense_reference(dtype: torch.dtype) -> None:
    backend = backend_for(torch.device("cuda"))  # no pool size given: the portable backend
    assert isinstance(backend, GatherBackend)
    step, q, k, v, k_cache, v_cache, reference = build_step(dtype, backend)
    out = attend_on_cuda(backend, step, dtype, q, k, v, k_cache, v_cache)
    torch.testing.assert_close(out.double().cpu(), reference, atol=3e-2, rtol=0)


def attend_on_cuda(backend: AttentionBackend, step: StepAttention, dtype: torch.dtype,
                   *tensors: torch.Tensor) -> torch.Tensor:
    """The CPU-built step (q, k, v, k_cache, v_cache and its metadata) moved to CUDA, planned and run."""
    meta = step.meta
    cuda_meta = AttentionMetadata(
        slot_mapping=meta.slot_mapping.cuda(), block_size=meta.block_size,
        spans=tuple(dataclasses.replace(s, block_table=s.block_table.cuda()) for s in meta.spans))
    q, k, v, k_cache, v_cache = (t.cuda() for t in tensors)
    return attend(q, k, v, k_cache, v_cache, StepAttention(meta=backend.plan(cuda_meta, dtype=dtype), backend=backend))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: flex attention's fused Triton "
                    "kernel (torch.compile) only runs there; on CPU its eager path is tested above")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_flex_compiled_on_cuda_equals_dense_reference(dtype: torch.dtype) -> None:
    # Pages of 16, the smallest the Triton kernels take, and heads of 64 (the bundled model's; tl.dot
    # wants at least 16). Twice, so the second step reuses the compiled kernel with another page map
    # (rewritten in place) and must still be right.
    backend = backend_for(torch.device("cuda"), num_blocks=NUM_BLOCKS, block_size=16)
    assert isinstance(backend, FlexPagedBackend) and backend.compiled
    for seed in (0, 1):
        step, q, k, v, k_cache, v_cache, reference = build_step(dtype, backend, seed, block_size=16, head_dim=64)
        out = attend_on_cuda(backend, step, dtype, q, k, v, k_cache, v_cache)
        torch.testing.assert_close(out.double().cpu(), reference, atol=3e-2, rtol=0)
