"""Many short sequences in one padded SDPA call: the one place the CPU backend copies blocks.

A Python-level call per sequence and layer pays a kernel launch and its views, and copying a short
sequence's keys costs less than that. So sequences with short queries (decode, verify) and short
contexts go together: their blocks are gathered into one padded (B, L) batch with an additive mask.
Up to `MAX_CONTEXT` tokens the copy stays under the per-call cost it saves; longer sequences are read
in place. benchmarks/route_audit.py times the group against a call per sequence (`short_group_*`).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from decodeservice.engine.attention.metadata import SequenceSpan

MAX_QUERY = 32
MAX_CONTEXT = 256  # tokens
# CPU, bf16/fp16: two batched GEMMs instead of SDPA, whose CPU flash kernel is several times slower in
# bf16 than in fp32 on these short padded groups; in fp32 SDPA stays ahead, so fp32 keeps it (an A/B
# at 32 decodes over 256 keys, figures in this comment's git history; benchmarks/decode_step.py profiles
# the group inside a 32-stream step).
REDUCED = (torch.bfloat16, torch.float16)


@dataclass(frozen=True, kw_only=True)
class ShortGroup:
    span_indices: frozenset[int]  # which of the step's spans this group attends
    query_index: torch.Tensor  # (B, Q) index into the packed tokens; padding points at token 0
    query_valid: torch.Tensor  # (B, Q) bool
    block_tables: torch.Tensor  # (B, M) block ids, padded with 0
    attn_mask: torch.Tensor  # (B, 1, Q, M * block_size) additive: 0 where a query may attend, -inf elsewhere
    # Every sequence has Q queries, packed as tokens 0 .. B*Q-1 in order: queries are plain views.
    covers_all_in_order: bool

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """q (N, H, D) -> (B, Q, H, D) for the group's rows (padding rows hold garbage)."""
        b, q_len = self.query_index.shape
        flat = self.block_tables.reshape(-1)
        keys = k_cache.view(k_cache.shape[0], -1).index_select(0, flat).view(b, -1, *k_cache.shape[2:])
        values = v_cache.view(v_cache.shape[0], -1).index_select(0, flat).view(b, -1, *v_cache.shape[2:])
        queries = q[: b * q_len].view(b, q_len, *q.shape[1:]) if self.covers_all_in_order else q[self.query_index]
        if queries.dtype in REDUCED and queries.device.type == "cpu":
            return _attend_batched_matmuls(queries, keys, values, self.attn_mask)
        return F.scaled_dot_product_attention(
            queries.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=self.attn_mask, enable_gqa=True,
        ).transpose(1, 2)  # (B, Q, H, D)


def _attend_batched_matmuls(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q (B, Q, H, D), k/v (B, L, Hkv, D), mask (B, 1, Q, L) additive -> (B, Q, H, D): two batched GEMMs.

    The grouped query heads of one K/V head are rows of one GEMM, so K/V are read once and never expanded;
    the softmax runs in fp32, the probabilities are rounded back for the second GEMM (as decode_matmul.py).
    """
    b, q_len, h, d = q.shape
    _, length, hkv, _ = k.shape
    g = h // hkv
    rows = q.view(b, q_len, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b * hkv, g * q_len, d)
    # K laid out (B*Hkv, L, D) and handed over transposed (a BLAS flag, not a copy): a (D, L) copy moves
    # the same bytes with D-strided writes, which cost more than the GEMM saves.
    scores = torch.bmm(rows, k.permute(0, 2, 1, 3).reshape(b * hkv, length, d).transpose(1, 2))  # (B*Hkv, G*Q, L)
    scores32 = scores.view(b, hkv, g, q_len, length).float().mul_(d**-0.5).add_(mask.view(b, 1, 1, q_len, length))
    probs = torch.softmax(scores32, dim=-1).to(q.dtype).view(b * hkv, g * q_len, length)
    out = torch.bmm(probs, v.permute(0, 2, 1, 3).reshape(b * hkv, length, d))  # (B*Hkv, G*Q, D)
    return out.view(b, hkv, g, q_len, d).permute(0, 3, 1, 2, 4).reshape(b, q_len, h, d)


def build_short_group(spans: Seq[SequenceSpan], *, block_size: int, device: torch.device,
                      dtype: torch.dtype, max_context: int = MAX_CONTEXT,
                      exclude: frozenset[int] = frozenset()) -> ShortGroup | None:
    """The group of the step's short sequences but `exclude`, or None when fewer than two qualify."""
    chosen = [i for i, s in enumerate(spans)
              if i not in exclude and s.num_new <= MAX_QUERY and s.context_len <= max_context]
    if len(chosen) < 2:
        return None
    members = [spans[i] for i in chosen]
    b = len(members)
    max_q = max(s.num_new for s in members)
    max_blocks = max(s.block_table.shape[0] for s in members)
    tables = torch.zeros((b, max_blocks), dtype=torch.long, device=device)
    for row, span in enumerate(members):
        tables[row, : span.block_table.shape[0]] = span.block_table
    starts = torch.tensor([s.token_start for s in members])
    q_lens = torch.tensor([s.num_new for s in members])
    contexts = torch.tensor([s.context_len for s in members])
    i = torch.arange(max_q)
    valid = i.unsqueeze(0) < q_lens.unsqueeze(1)  # (B, Q)
    query_index = torch.where(valid, starts.unsqueeze(1) + i.unsqueeze(0), 0)
    # Query i of a sequence sits at position context - q_len + i and sees every key up to it.
    # Padding rows see at least key 0, so softmax never meets an all-masked row.
    limit = (contexts - q_lens).view(b, 1, 1) + i.view(1, max_q, 1)
    keys = torch.arange(max_blocks * block_size).view(1, 1, -1)
    mask = (keys <= limit).unsqueeze(1)  # (B, 1, Q, L)
    return ShortGroup(
        span_indices=frozenset(chosen),
        query_index=query_index.to(device),
        query_valid=valid.to(device),
        block_tables=tables,
        attn_mask=torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf")).to(device),
        covers_all_in_order=bool(valid.all()) and bool((starts == torch.arange(b) * max_q).all()),
    )
