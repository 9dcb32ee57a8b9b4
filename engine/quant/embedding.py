"""Token embeddings over quantized codes: only the looked-up rows are dequantized. Tied to an int4 or int8
head, they read the head's own codes (LlamaModel._quantize)."""

from __future__ import annotations

import torch
from torch import nn

from decodeservice.engine.quant.int4 import Int4Weight, unpack_nibbles


class Int4Embedding(nn.Module):
    """Token embedding over 4-bit codes: only the looked-up rows are dequantized."""

    packed: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor

    def __init__(self, weight: Int4Weight, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.shape
        self.group_size, self.dtype = weight.group_size, dtype
        self.register_buffer("packed", weight.packed.contiguous(), persistent=False)  # (V, C/2)
        self.register_buffer("scale", weight.scale.contiguous(), persistent=False)  # (V, C/G)
        self.register_buffer("offset", weight.offset.contiguous(), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # ids: (N,) -> (N, C)
        n, groups = ids.shape[0], self.embedding_dim // self.group_size
        codes = unpack_nibbles(self.packed.index_select(0, ids)).view(n, groups, self.group_size).float()
        rows = codes * self.scale.index_select(0, ids).unsqueeze(-1) + self.offset.index_select(0, ids).unsqueeze(-1)
        return rows.view(n, self.embedding_dim).to(self.dtype)


class Int8Embedding(nn.Module):
    """Token embedding over int8 codes, e.g. the tied head's own: only the looked-up rows are dequantized."""

    codes: torch.Tensor
    scales: torch.Tensor

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = codes.shape
        self.dtype = dtype
        self.register_buffer("codes", codes, persistent=False)  # (V, C) int8; the same tensor as a tied Int8Linear's
        self.register_buffer("scales", scales, persistent=False)  # (V,)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # ids: (N,) -> (N, C)
        codes = self.codes.index_select(0, ids).float()
        return (codes * self.scales.index_select(0, ids).float().unsqueeze(1)).to(self.dtype)
