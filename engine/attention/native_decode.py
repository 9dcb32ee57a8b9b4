"""The step's decodes and verifies in one native call per layer, read in place from the pool (paged_decode.cpp).

A verify's tokens are rows of their own: token i is a decode over the span's first L - Q + i + 1 keys; so
are a prompt chunk's. The kernel computes a span's consecutive rows as tiles that read each K/V row once,
each row's result bit for bit the one it gets alone (tests/engine/attention/test_native_tiles.py).

Built at first use for the ISA ATen dispatches to and cached (engine/cpp_extensions.py). A build that
fails or a kernel that disagrees with a float64 reference is logged and left out: the CPU backend's plain
path (gather.py's SDPA) runs instead (engine/plan/planner.py decides, paged_views.py dispatches).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from decodeservice.engine.attention import kv_int8
from decodeservice.engine.attention.metadata import SequenceSpan
from decodeservice.engine.cpp_extensions import build_extension

SOURCE = Path(__file__).with_name("paged_decode.cpp")
HEADERS = tuple(Path(__file__).with_name(name) for name in (
    "paged_decode_vectors.h", "paged_decode_items.h", "paged_decode_int8_rows.h"))
DTYPES = (torch.float32, torch.bfloat16)
# Keys per work item: every row's keys split at the multiples of CHUNK, whatever its length and the thread
# count, so that a row's result is the same alone, in a batch or in a tile of its prompt. Small enough
# that the items of one long decode deal out evenly over the threads, and a piece's scores (H x CHUNK
# fp32 per row) stay in L1/L2 (benchmarks/prompt_attention.py measures decode and prompt rows).
CHUNK = 256
# Consecutive rows of one sequence (a prompt chunk, a verify) read each K/V row once for up to this many
# rows: a prompt's rows otherwise each stream their keys anew (benchmarks/prompt_attention.py). The default;
# the engine's plan times the heights on its CPU (engine/plan/attention_tiles.py).
TILE_ROWS = 16
# Spans of up to this many new tokens take the kernel, a row per token (build_decode_group): a verify of
# up to 8 drafts (benchmarks/spec_decode.py measures the verify cost it gives). Prompt spans take it
# whatever their length where the backend asks (`prompts`), their rows computed in tiles.
MAX_NEW = 9


def applies(dtype: torch.dtype, head_dim: int) -> bool:
    """The cache dtypes and head sizes the kernel takes (2 to 16 vectors of 8 or 16 floats)."""
    return dtype in DTYPES and head_dim in (32, 64, 128)


@functools.cache
def decode_extension() -> ModuleType | None:
    """The built kernel, or None (disabled, no toolchain, or wrong results: logged)."""
    return build_extension(SOURCE, what="paged decode attention", check=_agrees, headers=HEADERS)


@dataclass(frozen=True, kw_only=True)
class DecodeGroup:
    """The step's decodes and verifies: which spans, the packed token of each kernel row, its table and length."""

    span_indices: frozenset[int]
    token_index: torch.Tensor  # (B,) packed token of each decode
    block_tables: torch.Tensor  # (B, M) int32, padded with block 0
    context_lens: torch.Tensor  # (B,) int32
    covers_all_in_order: bool  # the decodes are tokens 0 .. B - 1 in order

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *, module: ModuleType,
               tile_rows: int = TILE_ROWS) -> torch.Tensor:
        """q (N, H, D) -> (B, H, D) for the group's decodes; `tile_rows`: the plan's tile height (same bits at any)."""
        b = self.token_index.shape[0]
        queries = (q[:b] if self.covers_all_in_order else q.index_select(0, self.token_index)).contiguous()
        if k_cache.dtype == torch.int8:
            return paged_decode_int8(queries, k_cache, v_cache, self.block_tables, self.context_lens, module=module,
                                     tile_rows=tile_rows)
        return paged_decode(queries, k_cache, v_cache, self.block_tables, self.context_lens, module=module,
                            tile_rows=tile_rows)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, *, module: ModuleType, chunk: int = CHUNK,
                 tile_rows: int = TILE_ROWS) -> torch.Tensor:
    """q (B, H, D), caches (num_blocks, block_size, Hkv, D), tables (B, M) int32, lengths (B,) -> (B, H, D).

    Each row's result is bit for bit the same for every `tile_rows` (1: a row at a time)."""
    out = torch.empty_like(q)
    module.paged_decode(q, k_cache, v_cache, block_tables, context_lens, q.shape[-1] ** -0.5, chunk, tile_rows, out)
    return out


def paged_decode_int8(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                      context_lens: torch.Tensor, *, module: ModuleType, chunk: int = CHUNK,
                      tile_rows: int = TILE_ROWS) -> torch.Tensor:
    """paged_decode over int8 pools (num_blocks, block_size, Hkv, D + 4) of kv_int8.py's rows."""
    out = torch.empty_like(q)
    module.paged_decode_int8(q, k_pool, v_pool, block_tables, context_lens, q.shape[-1] ** -0.5, chunk, tile_rows,
                             out)
    return out


def build_decode_group(spans: Seq[SequenceSpan], *, device: torch.device, max_new: int = 1,
                       prompts: bool = False) -> DecodeGroup | None:
    """Every span of the step with at most `max_new` new tokens (0: none), and with `prompts` every prompt
    span whatever its length, one kernel row per token, or None.

    A span's token i sees its first context_len - num_new + i + 1 keys: the step's own K/V are in the pool
    before attention reads it, so a verify's tokens are decodes over growing prefixes of one table, each
    computed exactly as a plain decode at that position would be."""
    chosen = [i for i, s in enumerate(spans) if 1 <= s.num_new <= max_new or (prompts and s.prompt)]
    if not chosen:
        return None
    members = [spans[i] for i in chosen]
    width = max(s.block_table.shape[0] for s in members)
    rows = sum(s.num_new for s in members)
    tables = torch.zeros((rows, width), dtype=torch.int32, device=device)
    starts: list[int] = []
    lengths: list[int] = []
    for span in members:
        first = len(starts)
        tables[first : first + span.num_new, : span.block_table.shape[0]] = span.block_table
        starts += range(span.token_start, span.token_start + span.num_new)
        lengths += range(span.context_len - span.num_new + 1, span.context_len + 1)
    return DecodeGroup(
        span_indices=frozenset(chosen),
        token_index=torch.tensor(starts, dtype=torch.long, device=device),
        block_tables=tables,
        context_lens=torch.tensor(lengths, dtype=torch.int32, device=device),
        covers_all_in_order=starts == list(range(rows)),
    )


def reference_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor) -> torch.Tensor:
    """The same attention in float64 torch ops, gathered per sequence: what the kernel is checked against."""
    out = torch.empty(q.shape, dtype=torch.float64)
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    g = q.shape[1] // hkv
    for i, length in enumerate(context_lens.tolist()):
        blocks = block_tables[i, : -(-length // bs)].long()
        keys = k_cache[blocks].flatten(0, 1)[:length].double().repeat_interleave(g, dim=1)  # (L, H, D)
        values = v_cache[blocks].flatten(0, 1)[:length].double().repeat_interleave(g, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[i].double(), keys) * q.shape[-1] ** -0.5
        out[i] = torch.einsum("hl,lhd->hd", torch.softmax(scores, dim=-1), values)
    return out


def _agrees(module: ModuleType) -> bool:
    """Against float64 on random pools (fp32, bf16, int8 rows against their dequantized values): scattered
    tables, a partial last block, chunks merged, GQA."""
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(40, 16, 2, 64, generator=gen)
    v_cache = torch.randn(40, 16, 2, 64, generator=gen)
    lengths = torch.tensor([1, 17, 300, 129], dtype=torch.int32)
    tables = torch.randint(0, 40, (4, 19), generator=gen, dtype=torch.int32)  # blocks reused: still a valid read
    q = torch.randn(4, 6, 64, generator=gen)
    for dtype, tolerance in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        value = paged_decode(q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), tables, lengths, module=module, chunk=128)
        reference = reference_decode(q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), tables, lengths)
        if not torch.allclose(value.double(), reference, rtol=tolerance, atol=tolerance):
            return False
    k_pool, v_pool = kv_int8.pack_rows(k_cache), kv_int8.pack_rows(v_cache)
    if not _writes_as_torch(module, k_cache[:8].to(torch.bfloat16)) or not _writes_as_torch(module, v_cache[:8] * 1e-3):
        return False
    value = paged_decode_int8(q, k_pool, v_pool, tables, lengths, module=module, chunk=128)
    reference = reference_decode(q, kv_int8.unpack_rows(k_pool, torch.float32), kv_int8.unpack_rows(v_pool, torch.float32),
                                 tables, lengths)
    return torch.allclose(value.double(), reference, rtol=1e-4, atol=1e-4)


def _writes_as_torch(module: ModuleType, pool_like: torch.Tensor) -> bool:
    """write_int8_rows against kv_int8's torch ops, bit for bit: codes, scales and dequantized rows."""
    rows = pool_like.flatten(0, 1)  # (N, Hkv, D)
    rows[3].zero_()  # a zero row: scale 0, codes 0
    slots = torch.randperm(rows.shape[0] * 2, generator=torch.Generator().manual_seed(1))[: rows.shape[0]]
    shape = (rows.shape[0] * 2 // 16, 16, rows.shape[1], kv_int8.row_width(rows.shape[2]))
    native_pool, torch_pool = torch.zeros(shape, dtype=torch.int8), torch.zeros(shape, dtype=torch.int8)
    native_rows = kv_int8.write_rows(rows, native_pool, slots, module)
    torch_rows = kv_int8.write_rows(rows, torch_pool, slots, None)
    return torch.equal(native_pool, torch_pool) and torch.equal(native_rows, torch_rows)
