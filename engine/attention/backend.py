"""One interface for every attention backend, chosen by device."""

from __future__ import annotations

from typing import Protocol

import torch

from decodeservice.engine.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    name: str

    def plan(self, meta: AttentionMetadata, *, dtype: torch.dtype) -> AttentionMetadata:
        """Once per step: add what the backend derives from the spans for every layer to reuse."""
        ...

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q (N, H, D) and the step's own k/v (N, Hkv, D), already written to the caches
        (num_blocks, block_size, Hkv, D) -> attended values (N, H, D)."""
        ...


def backend_for(device: torch.device) -> AttentionBackend:
    from decodeservice.engine.attention.gather import GatherBackend
    from decodeservice.engine.attention.paged_views import PagedViewsBackend

    return PagedViewsBackend() if device.type == "cpu" else GatherBackend()
