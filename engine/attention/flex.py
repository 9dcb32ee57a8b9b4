"""GPU paged attention: torch's flex attention reading K/V in place from the pool, the page table in
the block mask.

Why flex attention and not FlashInfer: flex attention ships inside torch (already this engine's one
hard dependency), takes any power-of-two page size from 16 and grouped-query attention natively
(`enable_gqa`), and its mask is plain Python (`mask_mod`) that also runs on CPU: the eager reference
path there is what tests/engine/attention/ checks against the dense reference, so the mask the GPU
compiles is the one tested here. FlashInfer (BatchDecode/BatchPrefillWithPagedKVCacheWrapper) is the
faster-known alternative with the same inputs (block tables, context lengths), but it is a separate
CUDA-only wheel pinned to exact torch and CUDA versions and cannot run here at all; it would sit
behind the same AttentionBackend interface as a later optional extra.

Layout. One query batch element per sequence: q (B, H, Qmax, D), each sequence's Q new tokens padded
to the step's longest. K and V are the whole pool viewed as ONE batch element (1, Hkv, num_slots, D),
a strided view (no copy); flex broadcasts it over the B query elements because the block mask has
batch B. The block mask's KV block is the cache's page (`block_size` slots), so the sparse indices
ARE the page table: for query tile j of sequence b, kv_indices[b, 0, j] lists b's pages and
kv_num_blocks[b, 0, j] how many of them that tile can see (causal pruning at page granularity). The
fused kernel visits only those pages. `mask_mod` then decides each (query, slot) pair exactly, in
logical positions: a slot's page maps back to its index in b's table (`PageMap.logical`, -1 where the
page is not b's), and query i of a sequence with C cached keys sees logical keys 0 .. C + i. The eager
CPU path ignores the sparse indices and evaluates mask_mod over every slot of the pool, so there the
mask alone must reject other sequences' pages, which it does; tests/engine/attention/test_flex.py
checks pair by pair that the pages the GPU kernel visits hold every key the mask allows.

Per-step state lives in device tensors (PageMap, fixed capacity, updated in place) and `mask_mod` is
one bound method for the backend's life. The mask reads nothing per step from Python: torch.compile
specializes on Python numbers a mask closes over, so a per-step value there would recompile every
step (tests/engine/attention/test_flex.py counts the traces), and CUDA graphs (cuda_graphs.py) need
the same buffers at every replay. No tile is declared "full" (which would skip mask_mod): simpler, at
the cost of evaluating the mask on pages wholly inside the prefix.

On CUDA the flex call goes through torch.compile (that is what makes it one fused Triton kernel); on
CPU it runs eager, materializing (B, H, Qmax, num_slots) scores: a correctness reference, never the CPU
engine's backend (paged_views.py is). The CUDA path has never run on a GPU in this project.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from decodeservice.engine.attention.metadata import AttentionMetadata, SequenceSpan
from decodeservice.engine.errors import ConfigError
from decodeservice.engine.kv_cache import cdiv

# Queries per sparse tile: flex's default. A decode or verify step is one tile per sequence.
Q_TILE = 128
# The Triton kernels need tiles of at least 16 keys; the page is the tile, so pages must be as large.
MIN_CUDA_BLOCK_SIZE = 16
# The fused kernel's key tile (BLOCK_N) may not exceed a page: it must divide the sparse block size.
MAX_KEY_TILE = 64


class PageMap:
    """What mask_mod reads, for up to `capacity` sequences: where each pool page sits in each sequence.

    logical (capacity, num_blocks + 1): logical index of page p in sequence b's table, -1 if not b's;
    the extra last column absorbs the padding of shorter tables (no real slot maps to it).
    num_cached (capacity,): keys before the step's first new token; context (capacity,): cached + new.
    Rows past the step's sequence count keep stale values: no query reads them."""

    def __init__(self, *, capacity: int, num_blocks: int, block_size: int, device: torch.device) -> None:
        self.capacity, self.num_blocks, self.block_size = capacity, num_blocks, block_size
        self.logical = torch.full((capacity, num_blocks + 1), -1, dtype=torch.int32, device=device)
        self.num_cached = torch.zeros(capacity, dtype=torch.int32, device=device)
        self.context = torch.zeros(capacity, dtype=torch.int32, device=device)

    def mask_mod(self, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        # kv_idx is a pool slot; its logical position in sequence b decides. Padded query rows
        # (q_idx >= Q) see the whole context, so no row is empty; their output is discarded.
        logical = self.logical[b, kv_idx // self.block_size]
        position = logical * self.block_size + kv_idx % self.block_size
        return (logical >= 0) & (position <= self.num_cached[b] + q_idx) & (position < self.context[b])

    def fill(self, tables: torch.Tensor, num_cached: torch.Tensor, context: torch.Tensor) -> None:
        """In place, for B sequences: tables (B, P) page ids padded with num_blocks; (B,) lengths."""
        batch, pages = tables.shape
        logical = self.logical[:batch]
        logical.fill_(-1)
        ranks = torch.arange(pages, dtype=torch.int32, device=tables.device).expand(batch, pages)
        logical.scatter_(1, tables, ranks)  # padding lands in the spare last column
        self.num_cached[:batch].copy_(num_cached)
        self.context[:batch].copy_(context)


@dataclass(frozen=True, kw_only=True)
class PageTables:
    """A step's sequences as the padded tensors flex needs, built on the host and copied once."""

    tables: torch.Tensor  # (B, P) int64 page ids, padded with num_blocks
    num_cached: torch.Tensor  # (B,) int32
    context: torch.Tensor  # (B,) int32
    visible_pages: torch.Tensor  # (B, 1, R) int32: pages query tile j of sequence b can see
    kv_indices: torch.Tensor  # (B, 1, R, P) int32: the table, padding replaced by page 0 (never visited)


def page_tables(spans: Sequence[tuple[list[int], int, int]], *, num_blocks: int, block_size: int,
                max_new: int, device: torch.device, pages: int | None = None) -> PageTables:
    """From (page table, cached, new) per sequence. `pages` fixes P (CUDA graphs); default the longest."""
    width = pages if pages is not None else max(len(t) for t, _, _ in spans)
    tiles = cdiv(max_new, Q_TILE)
    tables, visible = [], []
    for table, cached, new in spans:
        tables.append(table + [num_blocks] * (width - len(table)))
        # tile j's last real query is min((j + 1) * Q_TILE, new) - 1; it sees keys 0 .. cached + that
        visible.append([min(len(table), cdiv(cached + min((j + 1) * Q_TILE, new), block_size)) for j in range(tiles)])
    host = torch.tensor(tables, dtype=torch.long)
    return PageTables(
        tables=host.to(device),
        num_cached=torch.tensor([c for _, c, _ in spans], dtype=torch.int32).to(device),
        context=torch.tensor([c + n for _, c, n in spans], dtype=torch.int32).to(device),
        visible_pages=torch.tensor(visible, dtype=torch.int32).unsqueeze(1).to(device),
        kv_indices=host.masked_fill(host == num_blocks, 0).to(torch.int32)[:, None, None, :]
        .expand(-1, 1, tiles, -1).contiguous().to(device),
    )


def block_mask_for(page_map: PageMap, visible_pages: torch.Tensor, kv_indices: torch.Tensor,
                   max_new: int) -> BlockMask:
    """The step's BlockMask over page_map's mask_mod; its tensors are used as given (not copied)."""
    return BlockMask.from_kv_blocks(
        visible_pages, kv_indices, BLOCK_SIZE=(Q_TILE, page_map.block_size), mask_mod=page_map.mask_mod,
        seq_lengths=(max_new, page_map.num_blocks * page_map.block_size), compute_q_blocks=False)


@dataclass(frozen=True, kw_only=True)
class FlexMetadata(AttentionMetadata):
    """AttentionMetadata plus what plan() built for every layer of the step."""

    block_mask: BlockMask
    max_new: int  # Qmax
    # Packed token t is row query_rows[t] of the (B * Qmax) padded queries; None when every sequence
    # has Qmax new tokens in order (decode, equal verifies): then padding is a reshape.
    query_rows: torch.Tensor | None
    generation: int  # which plan() filled the PageMap; attend() refuses a stale one


class FlexPagedBackend:
    """AttentionBackend over torch's flex attention; see the module docstring."""

    name = "flex"

    def __init__(self, *, num_blocks: int, block_size: int, device: torch.device,
                 compiled: bool | None = None, compile_backend: str | Callable[..., Any] = "inductor") -> None:
        if device.type == "cuda" and block_size < MIN_CUDA_BLOCK_SIZE:
            raise ConfigError(f"flex attention on CUDA needs block_size >= {MIN_CUDA_BLOCK_SIZE}, not {block_size}")
        self.num_blocks, self.block_size, self.device = num_blocks, block_size, device
        self.page_map = PageMap(capacity=8, num_blocks=num_blocks, block_size=block_size, device=device)
        self.generation = 0
        # CUDA: one fused kernel through inductor; CPU: eager, the reference path (see docstring).
        self.compiled = device.type == "cuda" if compiled is None else compiled
        self.kernel_options: dict[str, Any] = {"BLOCK_N": min(block_size, MAX_KEY_TILE)}
        self._flex: Callable[..., Any] = flex_attention
        if self.compiled:
            # dynamic=None: batch and query length go symbolic after their first change, so a server
            # compiles a handful of times, not per step. `compile_backend`: tests trace with a counting
            # backend on CPU (inductor's CPU flex kernel takes minutes to build here).
            compile_fn: Callable[[Any], Any] = torch.compile(dynamic=None, backend=compile_backend)
            self._flex = compile_fn(flex_attention)

    def plan(self, meta: AttentionMetadata, *, dtype: torch.dtype) -> FlexMetadata:
        if meta.block_size != self.block_size:
            raise ValueError(f"metadata block_size {meta.block_size} != backend's {self.block_size}")
        spans = meta.spans
        if len(spans) > self.page_map.capacity:  # grows rarely: a new buffer means one recompile
            self.page_map = PageMap(capacity=max(len(spans), 2 * self.page_map.capacity), num_blocks=self.num_blocks,
                                    block_size=self.block_size, device=self.device)
        max_new = max(s.num_new for s in spans)
        tables = page_tables([(t, s.num_cached, s.num_new) for t, s in zip(_tables(spans, self.block_size), spans,
                                                                         strict=True)],
                             num_blocks=self.num_blocks, block_size=self.block_size, max_new=max_new,
                             device=self.device)
        self.page_map.fill(tables.tables, tables.num_cached, tables.context)
        self.generation += 1
        fields = {f.name: getattr(meta, f.name) for f in dataclasses.fields(AttentionMetadata)}
        return FlexMetadata(**fields, block_mask=block_mask_for(self.page_map, tables.visible_pages,
                                                                 tables.kv_indices, max_new),
                            max_new=max_new, query_rows=_query_rows(spans, max_new, self.device),
                            generation=self.generation)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if not isinstance(meta, FlexMetadata):  # unplanned (tests): plan here, once per layer
            meta = self.plan(meta, dtype=q.dtype)
        if meta.generation != self.generation:
            raise RuntimeError("flex metadata from an earlier plan(): the page map now holds another step")
        return self.run(q, k_cache, v_cache, meta.block_mask, batch=len(meta.spans), max_new=meta.max_new,
                        query_rows=meta.query_rows)

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_mask: BlockMask, *,
            batch: int, max_new: int, query_rows: torch.Tensor | None) -> torch.Tensor:
        """q (N, H, D) packed -> (N, H, D): pad to (B, H, Qmax, D), one flex call, unpad."""
        n, h, d = q.shape
        if query_rows is None:
            padded = q.view(batch, max_new, h, d)
        else:
            padded = q.new_zeros(batch * max_new, h, d).index_copy_(0, query_rows, q).view(batch, max_new, h, d)
        keys = k_cache.view(1, -1, *k_cache.shape[2:]).transpose(1, 2)  # (1, Hkv, num_slots, D), a view
        values = v_cache.view(1, -1, *v_cache.shape[2:]).transpose(1, 2)
        with warnings.catch_warnings():
            # Eager (CPU) flex warns that it is unfused: that path is the reference here, on purpose.
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile",
                                    category=UserWarning)
            out: torch.Tensor = self._flex(padded.transpose(1, 2), keys, values, block_mask=block_mask, enable_gqa=True,
                             kernel_options=self.kernel_options if self.compiled else None)
        attended = out.transpose(1, 2)  # (B, Qmax, H, D)
        if query_rows is None:
            return attended.reshape(n, h, d)
        return attended.reshape(batch * max_new, h, d).index_select(0, query_rows)


def _tables(spans: Sequence[SequenceSpan], block_size: int) -> list[list[int]]:
    # One device-to-host copy per step on CUDA (a sync): AttentionMetadata carries the tables only as
    # device tensors (gather.py's input); the runner's host lists would spare it.
    lengths = [cdiv(s.context_len, block_size) for s in spans]
    flat: list[int] = torch.cat([s.block_table[:n] for s, n in zip(spans, lengths, strict=True)]).tolist()
    out, start = [], 0
    for n in lengths:
        out.append(flat[start : start + n])
        start += n
    return out


def _query_rows(spans: Sequence[SequenceSpan], max_new: int, device: torch.device) -> torch.Tensor | None:
    if all(s.num_new == max_new for s in spans) and all(s.token_start == i * max_new for i, s in enumerate(spans)):
        return None
    # Spans are in packed order (a metadata invariant), so span by span is token by token.
    rows = [i * max_new + j for i, s in enumerate(spans) for j in range(s.num_new)]
    return torch.tensor(rows, dtype=torch.long, device=device)
