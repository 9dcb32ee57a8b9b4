"""Owns the model and the K/V tensors; turns a scheduler plan into one forward pass."""

from __future__ import annotations

import functools
import itertools
import logging
import os
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from decodeservice.engine import elementwise
from decodeservice.engine.attention import (
    AttentionBackend,
    AttentionMetadata,
    SequenceSpan,
    StepAttention,
    backend_for,
    kv_int8,
    slot_of,
    slot_runs,
)
from decodeservice.engine.attention.gather import GatherBackend
from decodeservice.engine.attention.paged_views import PagedViewsBackend
from decodeservice.engine.compiled_step import MAX_ROWS, CompiledStep
from decodeservice.engine.config import ModelConfig
from decodeservice.engine.kv_cache import cdiv
from decodeservice.engine.model import ForwardBatch, LlamaModel
from decodeservice.engine.plan.execution import AttentionPlan
from decodeservice.engine.quant.kernel_plan import KernelPlan
from decodeservice.engine.quant.step_rows import StepRows
from decodeservice.engine.sampling_params import SamplingParams
from decodeservice.engine.scheduler import ScheduledSequence, SchedulerPlan
from decodeservice.engine.sequence import Sequence

if TYPE_CHECKING:
    from decodeservice.engine.cuda_graphs import DecodeGraphs

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class StepLogits:
    """Logits per scheduled sequence, in plan order: (r, V) rows for the positions it samples or
    verifies, or None for a prompt chunk that does not reach the end of its prompt."""

    rows: list[torch.Tensor | None]
    # Per sequence, the argmax of each of its rows, where any sequence in the step decodes greedily: found
    # for the whole step in one call (a call per row added a millisecond or two to a 32-stream step).
    # Greedy decodes take their token from it and greedy verifies their targets.
    argmax: list[list[int] | None] | None = None


def kv_row_shape(cfg: ModelConfig, kv_dtype: torch.dtype) -> tuple[int, int]:
    """(Hkv, row width) of one slot in the pool: an int8 pool's rows carry their scale (kv_int8.py)."""
    return cfg.num_kv_heads, kv_int8.row_width(cfg.head_dim) if kv_dtype == torch.int8 else cfg.head_dim


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype, num_layers: int) -> int:
    """`dtype`: the pool's (int8 for kv_int8.py's rows)."""
    heads, width = kv_row_shape(cfg, dtype)
    return 2 * num_layers * block_size * heads * width * torch.empty((), dtype=dtype).element_size()


class ModelRunner:
    def __init__(self, model: LlamaModel, *, num_blocks: int, block_size: int, device: torch.device,
                 dtype: torch.dtype, num_layers: int | None = None,
                 attention: AttentionPlan | None = None, attention_backend: AttentionBackend | None = None,
                 compile_step: bool = False, cuda_graphs: bool = False, kv_dtype: torch.dtype | None = None,
                 deterministic: bool = False, kernels: KernelPlan | None = None) -> None:
        """`dtype`: the activations'; `kv_dtype`: the pool's, `dtype` when None, or int8 (kv_int8.py).
        `attention`: the engine's plan for it (engine/plan), from which the backend is built; else
        `attention_backend` as given, else the device's default backend (backend_for).
        `deterministic` (EngineConfig.deterministic): every row of every step takes its row-invariant path,
        in the projections (step_rows.StepRows) and in attention (the CPU backend's kernel row per token).
        `kernels`: the plan the model's projections were built with (the execution plan's), whose row
        thresholds the compiled step is warmed up at."""
        cfg = model.config
        self.model = model
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.deterministic = deterministic
        self.kernels = kernels
        self.num_layers = num_layers or cfg.num_layers
        if attention is not None:
            from decodeservice.engine.plan.planner import build_backend

            attention_backend = build_backend(attention, num_blocks=num_blocks, block_size=block_size, device=device)
        self.attention_backend = attention_backend or backend_for(device, num_blocks=num_blocks, block_size=block_size,
                                                                  deterministic=deterministic)
        self.kv_dtype = kv_dtype or dtype
        backend = self.attention_backend
        if self.kv_dtype == torch.int8 and (cuda_graphs or not (
                isinstance(backend, GatherBackend) or (isinstance(backend, PagedViewsBackend) and backend.kv_int8))):
            raise ValueError(f"int8 KV pools need the gather backend or the CPU one planned for them (kv_int8), not "
                             f"{backend.name}{' with CUDA graphs' if cuda_graphs else ''}")
        # The head's rows: no prompt rows among them; in deterministic mode their one path.
        self.head_rows = StepRows(deterministic=deterministic)
        shape = (num_blocks, block_size, *kv_row_shape(cfg, self.kv_dtype))
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.kv_dtype, device=device), torch.zeros(shape, dtype=self.kv_dtype, device=device))
            for _ in range(self.num_layers)
        ]
        # Decode steps through torch.compile (see compiled_step.py); compiled here, not on the first request.
        self.compiled: CompiledStep | None = None
        # Decode steps replayed from CUDA graphs (cuda_graphs.py), captured here; on CPU (tests) the same
        # static buffers run eager.
        self.graphs: DecodeGraphs | None = None
        if cuda_graphs:  # imported here: a torch without flex attention runs everything else
            from decodeservice.engine.attention.flex import FlexPagedBackend
            from decodeservice.engine.cuda_graphs import DecodeGraphs

            flex = self.attention_backend if isinstance(self.attention_backend, FlexPagedBackend) else \
                FlexPagedBackend(num_blocks=num_blocks, block_size=block_size, device=device)
            self.graphs = DecodeGraphs(model=model, kv_caches=self.kv_caches, num_layers=self.num_layers, flex=flex)
        if compile_step:
            # Minutes on a cold cache: say so, or a pod that is not Ready yet looks hung.
            log.info("compiling the decode step (torch.compile; minutes the first time, seconds from the "
                     "inductor cache at %s)", os.environ.get("TORCHINDUCTOR_CACHE_DIR", "its default place"))
            start = time.perf_counter()
            self.compiled = CompiledStep(model)
            self._warm_up()
            log.info("decode step compiled in %.1f s", time.perf_counter() - start)

    def execute(self, plan: SchedulerPlan) -> StepLogits:
        if self.graphs is not None and (hidden := self.graphs.run(plan.scheduled)) is not None:
            logits = self.model.compute_logits(hidden)  # (S, V): one row per sequence
            return self._split(logits, [1] * logits.shape[0], plan)
        batch, row_counts = self.build_batch(plan.scheduled)
        forward = self.compiled if self.compiled is not None and self.compiled.applies_to(batch) else self.model.forward
        hidden = forward(batch, self.kv_caches, num_layers=self.num_layers)
        logits = self.model.compute_logits(hidden, self.head_rows)  # deterministic mode: the head's one path
        return self._split(logits, row_counts, plan)

    def _split(self, logits: torch.Tensor, row_counts: list[int], plan: SchedulerPlan) -> StepLogits:
        return _split(logits, row_counts, plan, greedy_kernel=self.model.elementwise_plan.kernel)

    def _warm_up(self) -> None:
        """Run decode steps of 1, 2 and each row threshold of the model's kernel plan up to MAX_ROWS, so
        that every graph the compiled step has (compiled_step.py) is compiled at start-up, not on a
        request. Each row is a decode row (one prompt token computed, one output token to run: no prompt
        row, as in the steps the graphs serve) whose blocks are block 0, which is free: whoever gets it
        writes its own K/V before attention reads any, and what these rows compute is thrown away."""
        linears = self.kernels.linears.values() if self.kernels is not None else ()
        thresholds = {t for t in (plan.w8a8_from for plan in linears) if t is not None and 2 < t <= MAX_ROWS}
        for rows in (1, 2, *sorted(thresholds)):
            scheduled = [
                ScheduledSequence(seq=Sequence(request_id=f"warm-up-{i}", prompt_token_ids=[0], output_token_ids=[0],
                                               params=SamplingParams(max_tokens=2), block_ids=[0, 0],
                                               num_computed_tokens=1),
                                  num_new_tokens=1, num_spec_tokens=0)
                for i in range(rows)]
            self.execute(SchedulerPlan(scheduled=scheduled))

    def build_batch(self, scheduled: list[ScheduledSequence]) -> tuple[ForwardBatch, list[int]]:
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_index: list[int] = []
        row_counts: list[int] = []
        spans: list[SequenceSpan] = []
        bs = self.block_size
        for item in scheduled:
            seq, start = item.seq, len(input_ids)
            first, count = seq.num_computed_tokens, item.num_new_tokens
            tokens = seq.token_ids + seq.spec_token_ids[: item.num_spec_tokens]
            input_ids.extend(tokens[first : first + count])
            positions.extend(range(first, first + count))
            blocks = seq.block_ids
            slots.extend(slot_of(blocks, p, bs) for p in range(first, first + count))
            num_rows = item.num_spec_tokens + 1 if item.completes_prompt else 0
            logits_index.extend(range(start + count - num_rows, start + count))
            row_counts.append(num_rows)
            context = first + count
            table = blocks[: cdiv(context, bs)]
            spans.append(SequenceSpan(
                token_start=start, num_new=count, context_len=context,
                runs=slot_runs(table, num_tokens=context, block_size=bs),
                block_table=torch.tensor(table, dtype=torch.long, device=self.device),
                prompt=item.num_spec_tokens == 0 and (count > 1 or first < seq.num_prompt_tokens)))
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
                                 spans=tuple(spans), block_size=bs)
        # The step's own row split, handed down its forward (quant/step_rows.py). Per step, as the rows are:
        # engines of both modes may share one model's weights (tests do).
        rows = _step_rows(meta.spans, device=self.device, deterministic=self.deterministic)
        batch = ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=self.device),
            positions=torch.tensor(positions, dtype=torch.long, device=self.device),
            attn=StepAttention(meta=self.attention_backend.plan(meta, dtype=self.dtype), backend=self.attention_backend),
            logits_index=torch.tensor(logits_index, dtype=torch.long, device=self.device),
            rows=rows,
        )
        return batch, row_counts


def _step_rows(spans: Seq[SequenceSpan], *, device: torch.device, deterministic: bool) -> StepRows:
    """The step's prompt rows and its other rows (quant/step_rows.StepRows): none without prompt rows,
    the prompt rows alone with nothing else; where each kind is one run of rows, the prompt rows' span too."""
    prompt = [i for s in spans if s.prompt for i in range(s.token_start, s.token_start + s.num_new)]
    if not prompt:
        return StepRows(deterministic=deterministic)
    other = [i for s in spans if not s.prompt for i in range(s.token_start, s.token_start + s.num_new)]
    as_tensor = functools.partial(torch.tensor, dtype=torch.long, device=device)
    if not other:
        return StepRows(prompt_rows=as_tensor(prompt), deterministic=deterministic)
    runs = prompt[-1] - prompt[0] + 1 == len(prompt) and other[-1] - other[0] + 1 == len(other)
    return StepRows(prompt_rows=as_tensor(prompt), other_rows=as_tensor(other), deterministic=deterministic,
                    prompt_span=(prompt[0], prompt[-1] + 1) if runs else None)


def _split(logits: torch.Tensor, row_counts: list[int], plan: SchedulerPlan, *,
           greedy_kernel: ModuleType | None) -> StepLogits:
    """(S, V) logits of the step -> each sequence's rows (row_counts[i] of them, in plan order), and every
    row's greedy token where a sequence samples greedily (`greedy_kernel`: the model's native passes, or None)."""
    starts = [0, *itertools.accumulate(row_counts)][:-1]
    rows = [logits[s : s + n] if n else None for s, n in zip(starts, row_counts, strict=True)]
    if not any(item.seq.params.greedy for item in plan.scheduled):
        return StepLogits(rows=rows)
    argmax = elementwise.greedy_tokens(logits, greedy_kernel).tolist()
    return StepLogits(rows=rows, argmax=[argmax[s : s + n] if n else None for s, n in zip(starts, row_counts, strict=True)])
