"""Owns the model and the K/V tensors; turns a scheduler plan into one forward pass."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decodeservice.engine.config import ModelConfig
from decodeservice.engine.model import DecodeGroup, ForwardBatch, LlamaModel, PrefillSlice
from decodeservice.engine.scheduler import ScheduledSequence, SchedulerPlan

# Sequences feeding at most this many tokens in a step share one padded attention call; longer
# prompt chunks attend alone, so a decode is never padded up to a prompt's length.
SHORT_QUERY_TOKENS = 32


@dataclass(frozen=True, kw_only=True)
class StepLogits:
    """Logits per scheduled sequence, in plan order: (r, V) rows for the positions it samples or
    verifies, or None for a prompt chunk that does not reach the end of its prompt."""

    rows: list[torch.Tensor | None]


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype, num_layers: int) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * element


class ModelRunner:
    def __init__(self, model: LlamaModel, *, num_blocks: int, block_size: int, device: torch.device,
                 dtype: torch.dtype, num_layers: int | None = None) -> None:
        cfg = model.config
        self.model = model
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.num_layers = num_layers or cfg.num_layers
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(self.num_layers)
        ]

    def execute(self, plan: SchedulerPlan) -> StepLogits:
        batch, row_counts = self.build_batch(plan.scheduled)
        hidden = self.model.forward(batch, self.kv_caches, num_layers=self.num_layers)
        logits = self.model.compute_logits(hidden)
        rows: list[torch.Tensor | None] = []
        start = 0
        for count in row_counts:
            rows.append(logits[start : start + count] if count else None)
            start += count
        return StepLogits(rows=rows)

    def build_batch(self, scheduled: list[ScheduledSequence]) -> tuple[ForwardBatch, list[int]]:
        input_ids: list[int] = []
        positions: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        logits_index: list[int] = []
        row_counts: list[int] = []
        short: list[tuple[int, int, int, list[int]]] = []  # (token start, q len, context len, blocks)
        prefills: list[PrefillSlice] = []
        bs = self.block_size
        for item in scheduled:
            seq, start = item.seq, len(input_ids)
            first, count = seq.num_computed_tokens, item.num_new_tokens
            tokens = seq.token_ids + seq.spec_token_ids[: item.num_spec_tokens]
            input_ids.extend(tokens[first : first + count])
            pos = torch.arange(first, first + count)
            table = torch.tensor(seq.block_ids, dtype=torch.long)
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            num_rows = item.num_spec_tokens + 1 if item.completes_prompt else 0
            logits_index.extend(range(start + count - num_rows, start + count))
            row_counts.append(num_rows)
            context = first + count
            if count <= SHORT_QUERY_TOKENS:
                short.append((start, count, context, seq.block_ids[: -(-context // bs)]))
            else:
                prefills.append(PrefillSlice(token_start=start, num_tokens=count, context_len=context,
                                             block_table=table[: -(-context // bs)].to(self.device)))
        batch = ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=self.device),
            positions=torch.cat(positions).to(self.device),
            slot_mapping=torch.cat(slots).to(self.device),
            decode=self._decode_group(short) if short else None,
            prefills=prefills,
            logits_index=torch.tensor(logits_index, dtype=torch.long, device=self.device),
        )
        return batch, row_counts

    def _decode_group(self, short: list[tuple[int, int, int, list[int]]]) -> DecodeGroup:
        b = len(short)
        max_q = max(q for _, q, _, _ in short)
        max_blocks = max(len(blocks) for *_, blocks in short)
        tables = torch.zeros((b, max_blocks), dtype=torch.long)
        for row, (*_, blocks) in enumerate(short):
            tables[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.long)
        starts = torch.tensor([s for s, _, _, _ in short])
        q_lens = torch.tensor([q for _, q, _, _ in short])
        contexts = torch.tensor([c for _, _, c, _ in short])
        i = torch.arange(max_q)
        valid = i.unsqueeze(0) < q_lens.unsqueeze(1)  # (B, Q)
        query_index = torch.where(valid, starts.unsqueeze(1) + i.unsqueeze(0), 0)
        # Query i of a sequence sits at position context - q_len + i and sees every key up to it.
        # Padding rows see at least key 0, so softmax never meets an all-masked row.
        limit = (contexts - q_lens).view(b, 1, 1) + i.view(1, max_q, 1)
        keys = torch.arange(max_blocks * self.block_size).view(1, 1, -1)
        mask = (keys <= limit).unsqueeze(1)  # (B, 1, Q, L)
        return DecodeGroup(
            query_index=query_index.to(self.device),
            query_valid=valid.to(self.device),
            block_tables=tables.to(self.device),
            attn_mask=torch.zeros(mask.shape, dtype=self.dtype).masked_fill_(~mask, float("-inf")).to(self.device),
            covers_all_in_order=bool(valid.all()) and bool((starts == torch.arange(b) * max_q).all()),
        )
