"""CPU paged attention: SDPA over views of the pool, merged by log-sum-exp. Nothing is copied.

Each sequence's keys are split into (a) its cached prefix, which every new token sees in full, and (b)
its Q new tokens, which see each other causally. (a) lies in the pool as a few runs of consecutive
slots (usually one), each a strided view; (b) is the step's own fresh K/V. Every piece goes through
the CPU flash-attention kernel, which returns its log-sum-exp, and the pieces are merged exactly:
out = sum_i exp(lse_i - m) * out_i / sum_i exp(lse_i - m), m = max_i lse_i.
So no (T, L) mask is built and no block is gathered. Grouped-query attention needs no expanded K/V
for (a): the G query heads sharing a K/V head are folded into the query length, as every one of them
sees every prefix key. Measured against today's gather + masked SDPA in benchmarks/long_context.py.
In bf16/fp16 a decode or verify over at least decode_matmul.MIN_CONTEXT keys skips the flash kernel
for two GEMMs over the same views (decode_matmul.py: the kernel is slow for so few query rows).
Where the engine measured it faster (context_plan.py), every decode and verify of a step (up to
native_decode.MAX_NEW new tokens, a kernel row each) goes through the native paged-decode kernel
instead, in one call per layer (native_decode.py).
Wherever that kernel is built, every prompt span takes it too, whatever is measured for decodes: a row
per token over its own prefix, read from the pool (its own K/V as the pool holds them), in an order that
depends only on the row's position. So a prompt row computes the same function whether its prompt was
a cache miss or a hit of any number of blocks, and however it was chunked: the SDPA over a whole fresh
prompt and the merge of a cached prefix with a fresh piece round differently (in bf16 they moved the
next token's logprobs by up to ~1 nat on the bundled model; benchmarks/prefix_consistency.py).
In deterministic mode (EngineConfig.deterministic) every span of every step takes that kernel, a row per
token, whatever its length and whatever else the step holds: a row's attention then depends on its own
query and prefix alone (the kernel splits a row's keys by its length and the thread count only).
"""

from __future__ import annotations

import dataclasses
from types import ModuleType

import torch
import torch.nn.functional as F

from decodeservice.engine.attention import decode_matmul, kv_int8, native_decode
from decodeservice.engine.attention.metadata import AttentionMetadata, SequenceSpan, SlotRun, trim_runs
from decodeservice.engine.attention.native_decode import DecodeGroup, build_decode_group

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
# Beyond this many runs of slots a sequence's cached keys are gathered into one piece (see below).
MAX_RUNS = 4


def _prefix_piece(q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, run: SlotRun
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """q (Q, H, D) against one run of pool slots, unmasked -> out (Q, H, D), lse (Q, H) fp32."""
    t, h, d = q.shape
    hkv = k_flat.shape[1]
    g = h // hkv
    # Head h uses K/V head h // g; its g query heads become g * Q rows of one K/V head: (1, Hkv, G*Q, D)
    folded = q.view(t, hkv, g, d).permute(1, 2, 0, 3).reshape(1, hkv, g * t, d)
    end = run.first_slot + run.length
    keys = k_flat[run.first_slot : end].permute(1, 0, 2).unsqueeze(0)  # (1, Hkv, n, D), a view
    values = v_flat[run.first_slot : end].permute(1, 0, 2).unsqueeze(0)
    out, lse = _flash(folded, keys, values)  # (1, Hkv, G*Q, D), (1, Hkv, G*Q)
    return out.view(hkv, g, t, d).permute(2, 0, 1, 3).reshape(t, h, d), lse.view(hkv, g, t).permute(2, 0, 1).reshape(t, h)


def _prefix_pieces(q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, runs: list[SlotRun]
                   ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One piece per run; a table scattered over more than MAX_RUNS runs is gathered into one.

    Each run costs a kernel call and a term of the merge, so on a fragmented table (a pool that has
    been churned for long) a copy of the keys is cheaper than many tiny calls. The allocator keeps
    tables in few runs, so this is the exception."""
    if len(runs) <= MAX_RUNS:
        return [_prefix_piece(q, k_flat, v_flat, run) for run in runs]
    keys, values, whole = _gathered(k_flat, v_flat, runs)
    return [_prefix_piece(q, keys, values, whole)]


def _gathered(k_flat: torch.Tensor, v_flat: torch.Tensor, runs: list[SlotRun]
              ) -> tuple[torch.Tensor, torch.Tensor, SlotRun]:
    """The keys and values of `runs` copied into one run (for a table scattered over many)."""
    slots = torch.cat([torch.arange(r.first_slot, r.first_slot + r.length, device=k_flat.device) for r in runs])
    return k_flat.index_select(0, slots), v_flat.index_select(0, slots), SlotRun(first_slot=0, length=slots.shape[0])


def _dequantized(k_flat: torch.Tensor, v_flat: torch.Tensor, runs: tuple[SlotRun, ...], dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor, SlotRun]:
    """The keys and values of `runs` from int8 pools (kv_int8.py), in `dtype`, as one run."""
    keys, values, whole = _gathered(k_flat, v_flat, list(runs))
    return kv_int8.unpack_rows(keys, dtype), kv_int8.unpack_rows(values, dtype), whole


def _fresh_piece(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q new tokens among themselves, causal: q (Q, H, D), k/v (Q, Hkv, D) -> out (Q, H, D), lse (Q, H)."""
    g = q.shape[1] // k.shape[1]
    keys = k.repeat_interleave(g, dim=1).transpose(0, 1).unsqueeze(0)  # (1, H, Q, D); Q is small here
    values = v.repeat_interleave(g, dim=1).transpose(0, 1).unsqueeze(0)
    out, lse = _flash(q.transpose(0, 1).unsqueeze(0), keys, values, is_causal=True)  # (1, H, Q, D), (1, H, Q)
    return out[0].transpose(0, 1), lse[0].transpose(0, 1)


def _merge(pieces: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype) -> torch.Tensor:
    """Exact softmax over the union of the pieces' keys, from each piece's output and log-sum-exp."""
    lses = torch.stack([lse.float() for _, lse in pieces])  # (P, Q, H)
    weights = torch.softmax(lses, dim=0).unsqueeze(-1)  # (P, Q, H, 1) = exp(lse_i - logsumexp_j lse_j)
    outs = torch.stack([out.float() for out, _ in pieces])  # (P, Q, H, D)
    return (outs * weights).sum(0).to(dtype)


def _takes_matmul(span: SequenceSpan, dtype: torch.dtype, matmul_from: int | None) -> bool:
    """Whether `span` goes through decode_matmul.py (see attend_span's `matmul_from`)."""
    return matmul_from is not None and decode_matmul.applies(span, dtype, min_context=matmul_from)


def attend_span(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor,
                span: SequenceSpan, *, block_size: int, matmul_from: int | None = decode_matmul.MIN_CONTEXT) -> torch.Tensor:
    """One sequence's new tokens: q (Q, H, D), fresh k/v (Q, Hkv, D) -> (Q, H, D).

    `matmul_from`: the context length from which a decode or verify goes through decode_matmul.py
    (reduced precision only); None keeps every span on the flash kernel."""
    if _takes_matmul(span, q.dtype, matmul_from):
        runs = list(span.runs)
        if len(runs) > MAX_RUNS:
            keys, values, whole = _gathered(k_flat, v_flat, runs)
            return decode_matmul.attend_matmul(q, keys, values, [whole], block_size=1)
        return decode_matmul.attend_matmul(q, k_flat, v_flat, runs, block_size=block_size)
    if span.num_new == 1:
        # A single query sees every key, its own included (already written): the pool alone will do.
        pieces = _prefix_pieces(q, k_flat, v_flat, list(span.runs))
        return pieces[0][0] if len(pieces) == 1 else _merge(pieces, q.dtype)
    if span.num_cached == 0:
        attended = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
            is_causal=True, enable_gqa=True)  # (1, H, Q, D)
        return attended[0].transpose(0, 1)
    pieces = _prefix_pieces(q, k_flat, v_flat, trim_runs(span.runs, span.num_cached))
    pieces.append(_fresh_piece(q, k, v))
    return _merge(pieces, q.dtype)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PagedViewsMetadata(AttentionMetadata):
    """AttentionMetadata plus what the CPU backend's plan() built once for every layer of the step."""

    # The step's decodes and verifies, a row per token, for the native kernel.
    decode_group: DecodeGroup | None = None


class PagedViewsBackend:
    """The CPU backend: the native kernel's rows where it is built (see the module's docstring), else every
    sequence read in place on its own; long bf16/fp16 decodes and verifies go through decode_matmul.py from
    `matmul_from` keys. benchmarks/route_audit.py times each route against the per-sequence path."""

    name = "paged_views"

    def __init__(self, *, matmul_from: int | None = decode_matmul.MIN_CONTEXT,
                 decode_kernel: ModuleType | None = None, prompt_kernel: ModuleType | None = None,
                 kv_int8: bool = False, kernel_max_new: int = native_decode.MAX_NEW,
                 deterministic: bool = False) -> None:
        """Every choice is the engine's plan (engine/plan), handed down here once; nothing changes after."""
        self.matmul_from = matmul_from  # see attend_span; None is the flash kernel only (an A/B baseline)
        # native_decode.decode_extension() where it takes one-token decodes (fp32/bf16 caches, int8 pools)
        self.decode_kernel = decode_kernel
        # The pools hold int8 rows (kv_int8.py): decodes take the native kernel, every other span a
        # dequantized copy of its keys (see _attend_int8).
        self.kv_int8 = kv_int8
        # Spans of up to this many new tokens (decodes and verifies) take the native kernel, a row per
        # token; longer ones the torch paths. 1: decodes only (an A/B baseline).
        self.kernel_max_new = kernel_max_new
        # The same kernel for every prompt span (see the module's docstring), wherever it is built, whether
        # or not decodes take it; None: prompts take the torch paths.
        self.prompt_kernel = prompt_kernel
        # Every span through the kernel (the module's docstring); the engine refuses the mode where the
        # kernel is not built.
        self.deterministic = deterministic

    def plan(self, meta: AttentionMetadata, *, dtype: torch.dtype) -> PagedViewsMetadata:
        if self.deterministic:
            assert self._kernel() is not None and dtype in native_decode.DTYPES, "deterministic needs the native kernel"
            fields = {f.name: getattr(meta, f.name) for f in dataclasses.fields(AttentionMetadata)}
            every = max(span.num_new for span in meta.spans)
            return PagedViewsMetadata(**fields, decode_group=build_decode_group(
                meta.spans, device=meta.slot_mapping.device, max_new=every, prompts=True))
        device = meta.slot_mapping.device
        prompts = self.prompt_kernel is not None and dtype in native_decode.DTYPES
        decodes = (build_decode_group(meta.spans, device=device, max_new=self.kernel_max_new if self._native(dtype) else 0,
                                      prompts=prompts)
                   if self._native(dtype) or prompts else None)
        fields = {f.name: getattr(meta, f.name) for f in dataclasses.fields(AttentionMetadata)}
        return PagedViewsMetadata(**fields, decode_group=decodes)

    def _native(self, dtype: torch.dtype) -> bool:
        return self.decode_kernel is not None and dtype in native_decode.DTYPES

    def _kernel(self) -> ModuleType | None:
        """The built kernel, for the step's decode group (decodes, verifies and prompt spans)."""
        return self.decode_kernel if self.decode_kernel is not None else self.prompt_kernel

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # Unplanned metadata (tests, benchmarks) reads every sequence on its own.
        planned = meta if isinstance(meta, PagedViewsMetadata) else None
        if k_cache.dtype == torch.int8:
            return self._attend_int8(q, k, v, k_cache, v_cache, meta, planned)
        kernel = self._kernel()
        decodes = planned.decode_group if planned is not None and kernel is not None else None
        if decodes is not None:
            assert kernel is not None
            decoded = decodes.attend(q, k_cache, v_cache, module=kernel)  # (B, H, D)
            if len(decodes.span_indices) == len(meta.spans) and decodes.covers_all_in_order:
                return decoded  # every token of the step is a decode
        k_flat = k_cache.view(-1, *k_cache.shape[2:])  # (num_slots, Hkv, D)
        v_flat = v_cache.view(-1, *v_cache.shape[2:])
        if len(meta.spans) == 1 and decodes is None:
            return attend_span(q, k, v, k_flat, v_flat, meta.spans[0], block_size=meta.block_size,
                               matmul_from=self.matmul_from)
        out = torch.empty_like(q)  # (N, H, D)
        if decodes is not None:
            out[decodes.token_index] = decoded
        for i, span in enumerate(meta.spans):
            if decodes is not None and i in decodes.span_indices:
                continue
            s, e = span.token_start, span.token_start + span.num_new
            out[s:e] = attend_span(q[s:e], k[s:e], v[s:e], k_flat, v_flat, span, block_size=meta.block_size,
                                     matmul_from=self.matmul_from)
        return out

    def _attend_int8(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, meta: AttentionMetadata, planned: PagedViewsMetadata | None) -> torch.Tensor:
        """Over int8 pools: the step's decodes in the native kernel, which reads the rows as they are; every
        other span (prompt chunks, verifies, decodes where the kernel is missing) over a dequantized copy of
        its cached keys. The copy costs about what a bf16 pool's read does, and those spans are few and short-lived."""
        out = torch.empty_like(q)  # (N, H, D)
        kernel = self._kernel()
        decodes = planned.decode_group if planned is not None and kernel is not None else None
        if decodes is not None:
            assert kernel is not None
            decoded = decodes.attend(q, k_cache, v_cache, module=kernel)  # (B, H, D)
            if len(decodes.span_indices) == len(meta.spans) and decodes.covers_all_in_order:
                return decoded
            out[decodes.token_index] = decoded
        k_flat = k_cache.view(-1, *k_cache.shape[2:])  # (num_slots, Hkv, D + 4)
        v_flat = v_cache.view(-1, *v_cache.shape[2:])
        for i, span in enumerate(meta.spans):
            if decodes is not None and i in decodes.span_indices:
                continue
            s, e = span.token_start, span.token_start + span.num_new
            # A prompt chunk reads its cached prefix from the pool and its own K/V as given (already the
            # pool's values): only the prefix is dequantized. A decode or a decode_matmul.py span reads all.
            reads_all = span.num_new == 1 or _takes_matmul(span, q.dtype, self.matmul_from)
            runs = tuple(span.runs if reads_all else trim_runs(span.runs, span.num_cached))
            if runs:
                keys, values, whole = _dequantized(k_flat, v_flat, runs, q.dtype)
                runs = (whole,)
            else:  # no cached prefix: attend_span reads the fresh K/V alone
                keys = values = k.new_empty((0, *k.shape[1:]))
            out[s:e] = attend_span(q[s:e], k[s:e], v[s:e], keys, values, dataclasses.replace(span, runs=runs),
                                   block_size=1, matmul_from=self.matmul_from)
        return out
