"""The attention cases of route_audit.py: each route of PagedViewsBackend.attend against the plain path
it replaces, on the bundled model's attention shapes (9 query heads, 3 K/V heads of 64, blocks of 16).

The CPU backend has two routes: the native paged kernel, and the plain path (gather.py's attend_span: copy
a sequence's blocks, one SDPA with its causal offset, int8 rows dequantized), which is what the backend
does for every span when it is given no kernel. So each case times the kernel on the step the plan gives
it against that backend without a kernel on the same step: decodes (1, 4, 16 sequences over 64 to 2600
keys) and prompt spans (16 to 512 rows, with and without a cached prefix). The torch routes the backend
once also had (decode GEMMs, the views of the pool merged by log-sum-exp, a gathered flash call for
scattered tables) left it when the kernel's decodes beat this plain path by 1.2x or more at every shape,
on both dispatches; their last figures are in route_audit.json's history in git.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from decodeservice.engine.attention import native_decode, paged_views
from decodeservice.engine.attention.metadata import AttentionMetadata, SequenceSpan, slot_runs

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
DECODE_ROWS = (1, 4, 16)
CONTEXTS = (64, 256, 1024, 2600)
PROMPT_ROWS = (16, 64, 256, 512)
PREFIX = 1024  # a prompt chunk's cached prefix (a prefix hit's tail, or a later chunk)


@dataclass(frozen=True, kw_only=True)
class Case:
    """One route on one shape, and the path it replaces there."""

    route: str
    reference: str
    shape: str
    run: Callable[[], object]
    plain: Callable[[], object]


@dataclass(frozen=True, kw_only=True)
class Step:
    """Sequences laid out in a pool, and their metadata."""

    q: torch.Tensor  # (N, H, D)
    k: torch.Tensor  # (N, Hkv, D): the step's fresh K/V (already in the pool)
    v: torch.Tensor
    k_cache: torch.Tensor  # (num_blocks, BLOCK, Hkv, D or D + 4)
    v_cache: torch.Tensor
    meta: AttentionMetadata


def make_step(*, seqs: int, new: int, context: int, dtype: torch.dtype, kv_dtype: torch.dtype, prompt: bool = False,
              gen: torch.Generator) -> Step:
    """`seqs` sequences of `context` keys each, the last `new` of them this step's, each table one run of
    consecutive blocks (the allocator's usual layout)."""
    from decodeservice.engine.attention import kv_int8

    per_seq = -(-context // BLOCK)
    num_blocks = seqs * per_seq + 1
    tables: list[torch.Tensor] = []
    spans: list[SequenceSpan] = []
    for i in range(seqs):
        table = torch.arange(1 + i * per_seq, 1 + (i + 1) * per_seq)
        tables.append(table)
        spans.append(SequenceSpan(token_start=i * new, num_new=new, context_len=context, prompt=prompt,
                                  runs=slot_runs(table.tolist(), num_tokens=context, block_size=BLOCK), block_table=table))
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    k_cache, v_cache = torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype)
    positions = torch.arange(context - new, context)
    slots = torch.cat([table[positions // BLOCK] * BLOCK + positions % BLOCK for table in tables])
    k = k_cache.view(-1, KV_HEADS, HEAD_DIM)[slots].clone()
    v = v_cache.view(-1, KV_HEADS, HEAD_DIM)[slots].clone()
    if kv_dtype == torch.int8:
        k_cache, v_cache = kv_int8.pack_rows(k_cache), kv_int8.pack_rows(v_cache)
        k, v = kv_int8.unpack_rows(kv_int8.pack_rows(k), dtype), kv_int8.unpack_rows(kv_int8.pack_rows(v), dtype)
    q = torch.randn(seqs * new, HEADS, HEAD_DIM, generator=gen).to(dtype)
    meta = AttentionMetadata(slot_mapping=slots, spans=tuple(spans), block_size=BLOCK)
    return Step(q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, meta=meta)


def cases(*, dtype: torch.dtype, kv_dtype: torch.dtype, kernel: ModuleType | None, gen: torch.Generator) -> list[Case]:
    """Every attention route this dispatch can run, on the shapes the plan would give it."""
    plain = paged_views.PagedViewsBackend(kv_int8=kv_dtype == torch.int8)  # no kernel: the plain path for every span
    out: list[Case] = []
    if kernel is None:
        return out  # the plain path alone: nothing to race

    def plain_call(s: Step) -> Callable[[], object]:
        return lambda: plain.attend(s.q, s.k, s.v, s.k_cache, s.v_cache, s.meta)

    def step(**kw: int | bool) -> Step:
        return make_step(dtype=dtype, kv_dtype=kv_dtype, gen=gen, **kw)  # type: ignore[arg-type]

    for b in DECODE_ROWS:
        for n in CONTEXTS:
            s = step(seqs=b, new=1, context=n)
            group = native_decode.build_decode_group(s.meta.spans, device=s.q.device)
            assert group is not None
            out.append(Case(route="native_kernel_decode", reference="plain", shape=f"{b} decodes x {n} keys",
                            run=lambda g=group, s=s: g.attend(s.q, s.k_cache, s.v_cache, module=kernel),
                            plain=plain_call(s)))
    # Prompt spans take the kernel for hit/miss consistency (paged_views.py), not for speed: timed all the same.
    for rows in PROMPT_ROWS:
        for prefix in (0, PREFIX):
            s = step(seqs=1, new=rows, context=prefix + rows, prompt=True)
            group = native_decode.build_decode_group(s.meta.spans, device=s.q.device, max_new=0, prompts=True)
            assert group is not None
            out.append(Case(route="native_kernel_prompt", reference="plain", shape=f"{rows} prompt rows + {prefix} cached",
                            run=lambda g=group, s=s: g.attend(s.q, s.k_cache, s.v_cache, module=kernel),
                            plain=plain_call(s)))
    return out
