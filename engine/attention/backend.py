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


def backend_for(device: torch.device, *, num_blocks: int | None = None, block_size: int = 16,
                deterministic: bool = False) -> AttentionBackend:
    """CPU: paged views. CUDA: flex attention over the pool (flex.py) where torch has it, the pool size
    is known and pages are at least flex.MIN_CUDA_BLOCK_SIZE; else the portable gather backend.
    `deterministic` (EngineConfig.deterministic, CPU only): see PagedViewsBackend."""
    from decodeservice.engine.attention.gather import GatherBackend
    from decodeservice.engine.attention.paged_views import PagedViewsBackend

    if device.type == "cpu":
        return PagedViewsBackend(deterministic=deterministic)
    if deterministic:
        raise ValueError(f"deterministic attention is the CPU backend's, not {device.type}'s")
    if device.type == "cuda" and num_blocks is not None:
        try:
            from decodeservice.engine.attention.flex import MIN_CUDA_BLOCK_SIZE, FlexPagedBackend
        except ImportError:  # a torch without torch.nn.attention.flex_attention (before 2.5)
            return GatherBackend()
        if block_size >= MIN_CUDA_BLOCK_SIZE:
            return FlexPagedBackend(num_blocks=num_blocks, block_size=block_size, device=device)
    return GatherBackend()
