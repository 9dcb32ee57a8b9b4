"""The plain path: copy a sequence's blocks out of the pool, then one SDPA per sequence.

It runs on any device and is what non-CPU devices use until a paged kernel sits behind the same
interface (FlashInfer's BatchDecode/BatchPrefillWithPagedKVCacheWrapper take the same block tables
and context lengths this metadata carries). The causal mask is `causal_lower_right`, which CUDA's
fused kernels apply without materializing it. On CPU it is the tested fallback of the views backend
(paged_views.py) wherever the native kernel is not built or does not apply, and the reference the
kernel is timed against (benchmarks/route_audit_attention.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from decodeservice.engine.attention import kv_int8
from decodeservice.engine.attention.metadata import AttentionMetadata, SequenceSpan


def gather_blocks(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """cache (num_blocks, block_size, Hkv, D), table (M,) -> (M * block_size, Hkv, D), a copy.

    index_select on a 2-D view copies whole blocks as rows; plain advanced indexing on the 4-D
    tensor is an order of magnitude slower on CPU."""
    rows = cache.view(cache.shape[0], -1).index_select(0, block_table)
    return rows.view(-1, *cache.shape[2:])


def attend_span(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, span: SequenceSpan) -> torch.Tensor:
    """One sequence's new tokens q (Q, H, D) over its keys in the pool (its own already written) -> (Q, H, D).

    Over int8 pools (kv_int8.py) the copied rows are dequantized to q's dtype."""
    t, length = span.num_new, span.context_len
    keys = gather_blocks(k_cache, span.block_table)[:length]  # (L, Hkv, D), or int8 rows of D + 4
    values = gather_blocks(v_cache, span.block_table)[:length]
    if keys.dtype == torch.int8:
        keys, values = kv_int8.unpack_rows(keys, q.dtype), kv_int8.unpack_rows(values, q.dtype)
    mask = causal_lower_right(t, length) if t > 1 else None  # one query sees every key
    attended = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0),
        values.transpose(0, 1).unsqueeze(0), attn_mask=mask, enable_gqa=True,
    )  # (1, H, Q, D)
    return attended[0].transpose(0, 1)


class GatherBackend:
    name = "gather"

    def plan(self, meta: AttentionMetadata, *, dtype: torch.dtype) -> AttentionMetadata:
        return meta

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        out = torch.empty_like(q)  # (N, H, D)
        for span in meta.spans:
            s, e = span.token_start, span.token_start + span.num_new
            out[s:e] = attend_span(q[s:e], k_cache, v_cache, span)
        return out
