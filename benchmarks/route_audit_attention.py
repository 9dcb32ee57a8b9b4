"""The attention cases of route_audit.py: each route of PagedViewsBackend.attend against the plain path
it replaces, on the bundled model's attention shapes (9 query heads, 3 K/V heads of 64, blocks of 16).
(The single-run flash call and the short group, which no default plan took, left the backend after the
first run: route_audit.json still holds their figures.)

The plain path is the backend given unplanned metadata and no kernel: every sequence on its own, its
cached keys read in place through the CPU flash kernel (one call per run of slots, merged by log-sum-exp),
a fresh prompt through causal SDPA, over int8 pools a dequantized copy of the keys. For the plain path's
own pieces (per-run merge, causal SDPA, prefix + fresh merge) the reference is the gather backend
(gather.py: copy the blocks, one SDPA per sequence), the portable path they replaced.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from decodeservice.engine.attention import decode_matmul, native_decode, paged_views
from decodeservice.engine.attention.gather import GatherBackend
from decodeservice.engine.attention.metadata import AttentionMetadata, SequenceSpan, SlotRun, slot_runs

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

    @property
    def flat(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_cache.view(-1, *self.k_cache.shape[2:]), self.v_cache.view(-1, *self.v_cache.shape[2:])


def make_step(*, seqs: int, new: int, context: int, dtype: torch.dtype, kv_dtype: torch.dtype, prompt: bool = False,
              runs: int = 1, gen: torch.Generator) -> Step:
    """`seqs` sequences of `context` keys each, the last `new` of them this step's; each table split into
    `runs` runs of consecutive blocks (1: the allocator's usual layout)."""
    from decodeservice.engine.attention import kv_int8

    per_seq = -(-context // BLOCK)
    num_blocks = seqs * (per_seq + runs) + 1
    order = torch.arange(1, num_blocks)
    tables: list[torch.Tensor] = []
    spans: list[SequenceSpan] = []
    for i in range(seqs):
        own = order[i * (per_seq + runs) : (i + 1) * (per_seq + runs)]
        # `runs` runs: skip a block between them, so each starts a new run of slots
        pieces = own[: per_seq + runs - 1].tensor_split(runs) if runs > 1 else [own[:per_seq]]
        table = torch.cat([p[:-1] if j < runs - 1 else p for j, p in enumerate(pieces)])[:per_seq]
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
    plain = paged_views.PagedViewsBackend(matmul_from=None)  # no kernel: unplanned metadata reads each sequence alone
    gather = GatherBackend()
    out: list[Case] = []

    def plain_call(s: Step) -> Callable[[], object]:
        return lambda: plain.attend(s.q, s.k, s.v, s.k_cache, s.v_cache, s.meta)

    def gather_call(s: Step) -> Callable[[], object]:
        return lambda: gather.attend(s.q, s.k, s.v, s.k_cache, s.v_cache, s.meta)

    def step(**kw: int | bool) -> Step:
        return make_step(dtype=dtype, kv_dtype=kv_dtype, gen=gen, **kw)  # type: ignore[arg-type]

    if kernel is not None:  # decodes, and prompt spans (a row per token: the same function hit or miss)
        for b in DECODE_ROWS:
            for n in CONTEXTS:
                s = step(seqs=b, new=1, context=n)
                group = native_decode.build_decode_group(s.meta.spans, device=s.q.device)
                assert group is not None
                out.append(Case(route="native_kernel_decode", reference="plain", shape=f"{b} decodes x {n} keys",
                                run=lambda g=group, s=s: g.attend(s.q, s.k_cache, s.v_cache, module=kernel),
                                plain=plain_call(s)))
        for rows in PROMPT_ROWS:
            for prefix in (0, PREFIX):
                s = step(seqs=1, new=rows, context=prefix + rows, prompt=True)
                group = native_decode.build_decode_group(s.meta.spans, device=s.q.device, max_new=0, prompts=True)
                assert group is not None
                out.append(Case(route="native_kernel_prompt", reference="plain", shape=f"{rows} prompt rows + {prefix} cached",
                                run=lambda g=group, s=s: g.attend(s.q, s.k_cache, s.v_cache, module=kernel),
                                plain=plain_call(s)))
    if kv_dtype == torch.int8:
        return out  # over int8 pools every other span reads a dequantized copy: the plain path itself
    if dtype in decode_matmul.DTYPES:
        for b in DECODE_ROWS:
            for n in (1024, 1536, 2600):
                s = step(seqs=b, new=1, context=n)
                out.append(Case(route="decode_gemms", reference="plain", shape=f"{b} decodes x {n} keys",
                                run=lambda s=s: _matmul_step(s), plain=plain_call(s)))
    for runs in (2, 4, 8, 32):
        s = step(seqs=1, new=1, context=1024, runs=runs)
        k_flat, v_flat = s.flat
        spans = list(s.meta.spans[0].runs)
        assert len(spans) == runs, (runs, spans)
        per_run, gathered = _run_paths(s.q, k_flat, v_flat, spans)
        if runs <= paged_views.MAX_RUNS:
            out.append(Case(route="per_run_flash_merge", reference="gathered_flash", shape=f"1 decode x 1024 keys in {runs} runs",
                            run=per_run, plain=gathered))
        else:
            out.append(Case(route="gathered_flash", reference="per_run_flash_merge", shape=f"1 decode x 1024 keys in {runs} runs",
                            run=gathered, plain=per_run))
    for rows in PROMPT_ROWS:
        for prefix in (0, PREFIX):
            s = step(seqs=1, new=rows, context=prefix + rows, prompt=True)
            out.append(Case(route="causal_sdpa" if prefix == 0 else "prefix_fresh_merge", reference="gather_sdpa",
                            shape=f"{rows} prompt rows + {prefix} cached", run=plain_call(s), plain=gather_call(s)))
    return out


def _run_paths(q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, runs: list[SlotRun]
               ) -> tuple[Callable[[], object], Callable[[], object]]:
    """A decode over `runs`: one flash call per run merged by log-sum-exp, and one over a gathered copy."""
    def per_run() -> object:
        return paged_views._merge([paged_views._prefix_piece(q, k_flat, v_flat, r) for r in runs], q.dtype)

    def gathered() -> object:
        return paged_views._prefix_piece(q, *paged_views._gathered(k_flat, v_flat, runs))[0]

    return per_run, gathered


def _matmul_step(s: Step) -> object:
    k_flat, v_flat = s.flat
    out = torch.empty_like(s.q)
    for span in s.meta.spans:
        out[span.token_start] = decode_matmul.attend_matmul(s.q[span.token_start : span.token_start + 1], k_flat, v_flat,
                                                            list(span.runs), block_size=BLOCK)[0]
    return out
