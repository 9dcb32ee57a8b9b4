"""Attention over the paged KV cache: the per-step metadata and the backends that read the pool.

`attend` is the whole of attention for a layer: write the step's K/V into the pool, then let the
step's backend read it. See paged_views.py (CPU, no copies) and gather.py (portable)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decodeservice.engine.attention import kv_int8, native_decode
from decodeservice.engine.attention.backend import AttentionBackend, backend_for
from decodeservice.engine.attention.metadata import (
    AttentionMetadata,
    SequenceSpan,
    SlotRun,
    slot_of,
    slot_runs,
)

__all__ = ["AttentionBackend", "AttentionMetadata", "SequenceSpan", "SlotRun", "StepAttention", "attend",
           "backend_for", "slot_of", "slot_runs"]


@dataclass(frozen=True, kw_only=True)
class StepAttention:
    """The metadata plus the backend that reads it: what every layer of one step is handed."""

    meta: AttentionMetadata
    backend: AttentionBackend


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           step: StepAttention) -> torch.Tensor:
    """q (N, H, D), k/v (N, Hkv, D); caches (num_blocks, block_size, Hkv, D), or int8 pools of
    (num_blocks, block_size, Hkv, D + 4) rows (kv_int8.py) -> (N, H, D)."""
    slots = step.meta.slot_mapping
    if k_cache.dtype == torch.int8:
        module = native_decode.decode_extension() if k_cache.is_cpu else None
        # Attention reads the values the pool holds, the fresh ones included (see kv_int8.py).
        k = kv_int8.write_rows(k, k_cache, slots, module)
        v = kv_int8.write_rows(v, v_cache, slots, module)
        return step.backend.attend(q, k, v, k_cache, v_cache, step.meta)
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v)
    return step.backend.attend(q, k, v, k_cache, v_cache, step.meta)
