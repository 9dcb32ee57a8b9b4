"""From how many cached keys a decode leaves the CPU flash kernel for decode_matmul.py's two GEMMs,
measured on this machine at the model's attention shapes (bf16/fp16 KV caches only).

decode_matmul.MIN_CONTEXT (1536) was one machine's crossover; the GEMMs' advantage depends on the CPU's
bf16 throughput, its caches and the thread count. So at start-up one decode query is timed both ways
over a ladder of context lengths, each call reading another layer's pool (colder caches, as a decode
step reads every layer in turn; within a memory budget), interleaved, min of a few rounds. The threshold is the first
rung from which the GEMMs win at every rung above; None (the flash kernel only) if they never do.
Cached beside the kernel plans, keyed by CPU, threads, torch and shapes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from decodeservice.engine.attention import decode_matmul
from decodeservice.engine.attention.metadata import SlotRun
from decodeservice.engine.attention.paged_views import _prefix_piece
from decodeservice.engine.quant.cpu import detect_cpu
from decodeservice.engine.quant.kernel_plan import first_win, plan_cache_path, read_cached, write_cached

CONTEXT_LADDER = (512, 1024, 1536, 2048, 3072, 4096)
# Layers' pools read in turn, as many as the model has, within a memory budget: a decode step reads
# every layer's K/V once (90 MB at 4k keys for the bundled model), but start-up must not add that to
# the engine's peak RSS. 32 MB is past every L2 and many L3s.
POOL_BUDGET_BYTES = 32 << 20
ROUNDS = 3


@dataclass(frozen=True, kw_only=True)
class MatmulChoice:
    min_context: int | None  # None: the flash kernel at every length
    timings_us: dict[str, dict[int, float]]  # "flash" / "matmul": per rung, best per-call microseconds
    source: str  # "measured" or the cache file


def choose_min_context(*, num_heads: int, num_kv_heads: int, head_dim: int, num_layers: int, dtype: torch.dtype,
                       block_size: int, cache_dir: Path | None = None) -> MatmulChoice:
    shape = f"attention {num_heads}/{num_kv_heads}x{head_dim} {num_layers} layers block {block_size}"
    cache = plan_cache_path(cache_dir, detect_cpu(), dtype, [shape], prefix="attention")
    cached = read_cached(cache, lambda raw: MatmulChoice(
        min_context=raw["min_context"], source=str(cache),
        timings_us={path: {int(n): float(us) for n, us in rungs.items()} for path, rungs in raw["timings_us"].items()}))
    if cached is not None:
        return cached
    timings = _measure(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
                       block_size=block_size, num_layers=num_layers)
    choice = MatmulChoice(min_context=first_win(timings["matmul"], timings["flash"]), timings_us=timings,
                          source="measured")
    write_cached(cache, {"min_context": choice.min_context, "timings_us": timings})
    return choice


def _measure(*, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int,
             num_layers: int) -> dict[str, dict[int, float]]:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, num_heads, head_dim, generator=gen).to(dtype)  # one decode query
    element = torch.empty((), dtype=dtype).element_size()
    timings: dict[str, dict[int, float]] = {"flash": {}, "matmul": {}}
    with torch.inference_mode():
        for context in CONTEXT_LADDER:
            pool_bytes = 2 * context * num_kv_heads * head_dim * element
            layers = [(torch.randn(context, num_kv_heads, head_dim, generator=gen).to(dtype),
                       torch.randn(context, num_kv_heads, head_dim, generator=gen).to(dtype))
                      for _ in range(max(2, min(num_layers, POOL_BUDGET_BYTES // pool_bytes)))]
            calls = _paths(q, SlotRun(first_slot=0, length=context), block_size=block_size)
            best = dict.fromkeys(calls, float("inf"))
            for call in calls.values():
                call(*layers[0])  # warm: oneDNN builds each GEMM shape once
            for _ in range(ROUNDS):
                for name, call in calls.items():
                    start = time.perf_counter()
                    for k, v in layers:
                        call(k, v)
                    best[name] = min(best[name], (time.perf_counter() - start) / len(layers) * 1e6)
            for name, us in best.items():
                timings[name][context] = round(us, 1)
            del layers
    return timings


def _paths(q: torch.Tensor, run: SlotRun, *, block_size: int) -> dict[str, Callable[[torch.Tensor, torch.Tensor], object]]:
    def flash(k: torch.Tensor, v: torch.Tensor) -> object:
        return _prefix_piece(q, k, v, run)

    def matmul(k: torch.Tensor, v: torch.Tensor) -> object:
        return decode_matmul.attend_matmul(q, k, v, [run], block_size=block_size)

    return {"flash": flash, "matmul": matmul}
