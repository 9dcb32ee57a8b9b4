"""CUDA graphs for the decode step: one token per sequence, replayed from static buffers.

A decode step of a small model on a GPU is launch-bound: ~10 kernels a layer, each a few microseconds
of work behind Python and dispatch. A CUDA graph records the whole forward once per batch-size bucket
(BUCKETS) and replays it as one launch. A graph replays fixed addresses and shapes, so:

- Inputs live in static buffers (token ids, positions, slot mapping) that each step copies into
  before `replay()`; the batch is padded up to the bucket.
- Padding rows are copies of the step's first sequence: same token, position, slot and page table.
  They compute the same K/V as that row and write it to the same slot, so they corrupt nothing and
  need no spare block in the pool; their hidden states are dropped.
- Attention is flex attention (attention/flex.py) over a block mask built ONCE per bucket from
  fixed-shape tensors: the page map (bucket, num_blocks + 1), the pages visible per sequence
  (bucket, 1, 1) and the page table (bucket, 1, 1, max pages per sequence, from the model's longest
  context). Each step rewrites them in place; the mask_mod reads them on the device. Nothing in the
  captured attention depends on Python-side per-step metadata.

Captured: only decode steps (every scheduled sequence has one new token, no drafts, and gets its
logits) of at most BUCKETS[-1] sequences. Everything else runs eager (prompt chunks and verifies have
a per-step query shape; larger batches are compute-bound, where a launch saves little).

On CPU (tests) there is nothing to capture: `run` executes the same forward eagerly on the same static
buffers, which checks the bucketing, padding and buffer copying against the normal forward. The
capture itself has never run on a GPU in this project; EngineConfig.cuda_graphs is off by default.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from decodeservice.engine.attention import AttentionMetadata, StepAttention, slot_of
from decodeservice.engine.attention.flex import FlexPagedBackend, PageMap, block_mask_for, page_tables
from decodeservice.engine.kv_cache import cdiv
from decodeservice.engine.model import ForwardBatch, LlamaModel
from decodeservice.engine.scheduler import ScheduledSequence

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

BUCKETS = (1, 2, 4, 8, 16, 32)
KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def bucket_for(num_seqs: int, buckets: Seq[int] = BUCKETS) -> int | None:
    """The smallest bucket holding `num_seqs` sequences; None above the largest (run eager)."""
    return next((b for b in buckets if b >= num_seqs), None)


def is_decode_step(scheduled: Seq[ScheduledSequence]) -> bool:
    return bool(scheduled) and all(
        item.num_new_tokens == 1 and item.num_spec_tokens == 0 and item.completes_prompt for item in scheduled)


@dataclass(frozen=True, kw_only=True)
class DecodeRows:
    """One decode step on the host, padded to its bucket: per row a token at a position, the pool slot
    its K/V goes to, and the page table covering its context (position + 1 keys)."""

    num_real: int
    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    tables: list[list[int]]


def decode_rows(scheduled: Seq[ScheduledSequence], *, block_size: int, bucket: int) -> DecodeRows:
    ids, positions, slots, tables = [], [], [], []
    for item in scheduled:
        seq, p = item.seq, item.seq.num_computed_tokens
        ids.append(seq.token_ids[p])
        positions.append(p)
        slots.append(slot_of(seq.block_ids, p, block_size))
        tables.append(seq.block_ids[: cdiv(p + 1, block_size)])
    pad = bucket - len(scheduled)  # copies of row 0: same K/V to the same slot (module docstring)
    return DecodeRows(num_real=len(scheduled), input_ids=ids + ids[:1] * pad, positions=positions + positions[:1] * pad,
                      slots=slots + slots[:1] * pad, tables=tables + tables[:1] * pad)


class _StaticAttention:
    """The AttentionBackend a captured forward calls: flex over the bucket's fixed block mask."""

    name = "flex_graph"

    def __init__(self, flex: FlexPagedBackend, graph: DecodeGraph) -> None:
        self.flex, self.graph = flex, graph

    def plan(self, meta: AttentionMetadata, *, dtype: torch.dtype) -> AttentionMetadata:
        return meta

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.flex.run(q, k_cache, v_cache, self.graph.block_mask, batch=self.graph.bucket, max_new=1,
                             query_rows=None)


class DecodeGraph:
    """One bucket: static inputs, the fixed block mask, and (CUDA) the captured forward."""

    def __init__(self, *, bucket: int, model: LlamaModel, kv_caches: KVCaches, num_layers: int,
                 flex: FlexPagedBackend, page_map: PageMap, max_pages: int) -> None:
        device = flex.device
        self.bucket, self.model, self.kv_caches, self.num_layers = bucket, model, kv_caches, num_layers
        self.block_size, self.max_pages = flex.block_size, max_pages
        self.input_ids = torch.zeros(bucket, dtype=torch.long, device=device)
        self.positions = torch.zeros(bucket, dtype=torch.long, device=device)
        # Slot 0 until the first step: warm-up writes block 0, free at start-up (as ModelRunner._warm_up).
        self.slot_mapping = torch.zeros(bucket, dtype=torch.long, device=device)
        self.page_map = page_map  # shared by the buckets: one replays at a time and fills its rows first
        self.visible_pages = torch.ones(bucket, 1, 1, dtype=torch.int32, device=device)
        self.kv_indices = torch.zeros(bucket, 1, 1, max_pages, dtype=torch.int32, device=device)
        self.block_mask = block_mask_for(self.page_map, self.visible_pages, self.kv_indices, 1)
        self.batch = ForwardBatch(
            input_ids=self.input_ids, positions=self.positions,
            attn=StepAttention(meta=AttentionMetadata(slot_mapping=self.slot_mapping, spans=(), block_size=self.block_size),
                               backend=_StaticAttention(flex, self)),
            logits_index=torch.arange(bucket, device=device))
        self.graph: torch.cuda.CUDAGraph | None = None
        self.hidden: torch.Tensor | None = None  # (bucket, C): the captured forward's output buffer

    def forward(self) -> torch.Tensor:
        return self.model.forward(self.batch, self.kv_caches, num_layers=self.num_layers)

    def capture(self, pool: _POOL_HANDLE) -> None:
        """Warm up on a side stream (compiles flex for this shape: nothing may compile during capture),
        then record the forward into this bucket's graph, sharing `pool` with the other buckets."""
        stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.forward()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.hidden = self.forward()

    def load(self, rows: DecodeRows) -> None:
        """Copy one step into the static buffers (shapes never change, addresses neither)."""
        device = self.input_ids.device
        self.input_ids.copy_(torch.tensor(rows.input_ids), non_blocking=device.type == "cuda")
        self.positions.copy_(torch.tensor(rows.positions), non_blocking=device.type == "cuda")
        self.slot_mapping.copy_(torch.tensor(rows.slots), non_blocking=device.type == "cuda")
        tables = page_tables([(t, p, 1) for t, p in zip(rows.tables, rows.positions, strict=True)],  # p keys cached
                             num_blocks=self.page_map.num_blocks, block_size=self.block_size, max_new=1,
                             device=device, pages=self.max_pages)
        self.page_map.fill(tables.tables, tables.num_cached, tables.context)
        self.visible_pages.copy_(tables.visible_pages)
        self.kv_indices.copy_(tables.kv_indices)

    def run(self, rows: DecodeRows) -> torch.Tensor:
        """Hidden states (num_real, C) after the final norm: the replay, or on CPU the eager forward
        over the same buffers."""
        self.load(rows)
        if self.graph is None:
            return self.forward()[: rows.num_real]
        self.graph.replay()
        assert self.hidden is not None
        return self.hidden[: rows.num_real]


class DecodeGraphs:
    """The buckets of one runner. Built once at start-up; `run` returns None for a step it does not cover."""

    def __init__(self, *, model: LlamaModel, kv_caches: KVCaches, num_layers: int, flex: FlexPagedBackend,
                 buckets: Seq[int] = BUCKETS) -> None:
        self.block_size = flex.block_size
        max_pages = cdiv(model.config.max_position_embeddings, flex.block_size)
        self.buckets = tuple(sorted(buckets))
        # One page map for every bucket: the same mask_mod and buffers (so torch.compile guards see one
        # object, not a recompile per bucket). Until the first step every row is one key at slot 0,
        # which is what warm-up writes.
        page_map = PageMap(capacity=self.buckets[-1], num_blocks=flex.num_blocks, block_size=flex.block_size,
                           device=flex.device)
        page_map.context.fill_(1)
        page_map.logical[:, 0] = 0
        self.graphs = {b: DecodeGraph(bucket=b, model=model, kv_caches=kv_caches, num_layers=num_layers, flex=flex,
                                      page_map=page_map, max_pages=max_pages) for b in self.buckets}
        if flex.device.type == "cuda":
            # One memory pool, largest bucket first: the smaller graphs reuse what the largest reserved.
            pool = torch.cuda.graph_pool_handle()
            for b in reversed(self.buckets):
                self.graphs[b].capture(pool)
            torch.cuda.synchronize()

    def run(self, scheduled: Seq[ScheduledSequence]) -> torch.Tensor | None:
        bucket = bucket_for(len(scheduled), self.buckets)
        if bucket is None or not is_decode_step(scheduled):
            return None
        return self.graphs[bucket].run(decode_rows(scheduled, block_size=self.block_size, bucket=bucket))
