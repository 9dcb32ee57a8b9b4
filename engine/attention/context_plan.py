"""How this machine's decodes read the KV pool, measured at start-up at the model's attention shapes:
from how many cached keys a decode leaves the CPU flash kernel for decode_matmul.py's two GEMMs
(bf16/fp16 KV caches only), and whether the native paged-decode kernel (native_decode.py) takes the
step's one-token decodes.

decode_matmul.MIN_CONTEXT (1536) was one machine's crossover; the GEMMs' advantage depends on the CPU's
bf16 throughput, its caches and the thread count. So at start-up one decode query is timed both ways
over a ladder of context lengths, each call reading another layer's pool (colder caches, as a decode
step reads every layer in turn; within a memory budget), interleaved, min of a few rounds. The threshold is the first
rung from which the GEMMs win at every rung above; None (the flash kernel only) if they never do.
The native kernel is timed on the same pools and on a batch of short decodes against reading each
sequence on its own; it is taken where, summed over the ladder, it is no slower than the torch path each
rung would otherwise take, and no slower on the batch.
Cached beside the kernel plans, keyed by CPU, threads, torch, shapes and whether the kernel was built.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from decodeservice.engine.attention import decode_matmul, native_decode
from decodeservice.engine.attention.metadata import SequenceSpan, SlotRun, slot_runs
from decodeservice.engine.attention.paged_views import _prefix_piece
from decodeservice.engine.quant.cpu import detect_cpu
from decodeservice.engine.quant.kernel_plan import first_win, plan_cache_path, read_cached, write_cached

CONTEXT_LADDER = (128, 256, 512, 1024, 1536, 2048, 3072, 4096)
# Layers' pools read in turn, as many as the model has, within a memory budget: a decode step reads
# every layer's K/V once (90 MB at 4k keys for the bundled model), but start-up must not add that to
# the engine's peak RSS. 32 MB is past every L2 and many L3s.
POOL_BUDGET_BYTES = 32 << 20
ROUNDS = 3
BATCH = 16  # decodes of BATCH_CONTEXT keys: the batch the native kernel must also win
BATCH_CONTEXT = 128


@dataclass(frozen=True, kw_only=True)
class AttentionChoice:
    min_context: int | None  # None: the flash kernel at every length
    native_decode: bool  # the step's one-token decodes go through native_decode.py
    # "flash" / "matmul" / "native": per rung, best per-call microseconds; "batch_torch" / "batch_native":
    # the batch's, keyed by its size
    timings_us: dict[str, dict[int, float]]
    source: str  # "measured" or the cache file


def choose_attention(*, num_heads: int, num_kv_heads: int, head_dim: int, num_layers: int, dtype: torch.dtype,
                     block_size: int, native: ModuleType | None = None,
                     cache_dir: Path | None = None) -> AttentionChoice:
    """`native`: the built paged-decode kernel (native_decode.decode_extension()), or None."""
    if not native_decode.applies(dtype, head_dim):
        native = None
    shape = (f"attention {num_heads}/{num_kv_heads}x{head_dim} {num_layers} layers block {block_size}"
             f"{' native' if native is not None else ''}")
    cache = plan_cache_path(cache_dir, detect_cpu(), dtype, [shape], prefix="attention")
    cached = read_cached(cache, lambda raw: AttentionChoice(
        min_context=raw["min_context"], native_decode=bool(raw["native_decode"]), source=str(cache),
        timings_us={path: {int(n): float(us) for n, us in rungs.items()} for path, rungs in raw["timings_us"].items()}))
    if cached is not None:
        return cached
    timings = _measure(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
                       block_size=block_size, num_layers=num_layers, native=native)
    min_context = first_win(timings["matmul"], timings["flash"]) if "matmul" in timings else None
    takes_native = native is not None and _native_wins(timings, min_context)
    choice = AttentionChoice(min_context=min_context, native_decode=takes_native, timings_us=timings, source="measured")
    write_cached(cache, {"min_context": min_context, "native_decode": takes_native, "timings_us": timings})
    return choice


def _native_wins(timings: dict[str, dict[int, float]], min_context: int | None) -> bool:
    """The native kernel against the torch path each rung would take (the GEMMs from min_context)."""
    def torch_path(n: int) -> float:
        return timings["matmul"][n] if min_context is not None and n >= min_context else timings["flash"][n]

    ladder = sum(timings["native"].values()) <= sum(torch_path(n) for n in timings["native"])
    return ladder and timings["batch_native"][BATCH] <= timings["batch_torch"][BATCH]


def _measure(*, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int,
             num_layers: int, native: ModuleType | None) -> dict[str, dict[int, float]]:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, num_heads, head_dim, generator=gen).to(dtype)  # one decode query
    element = torch.empty((), dtype=dtype).element_size()
    timings: dict[str, dict[int, float]] = {"flash": {}}
    if dtype in decode_matmul.DTYPES:
        timings["matmul"] = {}
    if native is not None:
        timings["native"] = {}
    with torch.inference_mode():
        for context in CONTEXT_LADDER:
            pool_bytes = 2 * context * num_kv_heads * head_dim * element
            layers = [(torch.randn(context, num_kv_heads, head_dim, generator=gen).to(dtype),
                       torch.randn(context, num_kv_heads, head_dim, generator=gen).to(dtype))
                      for _ in range(max(2, min(num_layers, POOL_BUDGET_BYTES // pool_bytes)))]
            calls = {name: call for name, call in _paths(q, SlotRun(first_slot=0, length=context), block_size=block_size,
                                                         native=native).items() if name in timings}
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
        if native is not None:
            timings.update(_measure_batch(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                          dtype=dtype, block_size=block_size, native=native, gen=gen))
    return timings


def _measure_batch(*, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int,
                   native: ModuleType, gen: torch.Generator) -> dict[str, dict[int, float]]:
    """BATCH decodes of BATCH_CONTEXT keys: a flash call per sequence (the torch path) vs the native kernel."""
    per_sequence = -(-BATCH_CONTEXT // block_size)
    num_blocks = BATCH * per_sequence + 1
    k_cache, v_cache = (torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
                        for _ in range(2))
    tables = torch.arange(1, num_blocks).view(BATCH, per_sequence)
    spans = [SequenceSpan(token_start=i, num_new=1, context_len=BATCH_CONTEXT - i % block_size,
                          runs=slot_runs(tables[i].tolist(), num_tokens=BATCH_CONTEXT - i % block_size, block_size=block_size),
                          block_table=tables[i]) for i in range(BATCH)]
    q = torch.randn(BATCH, num_heads, head_dim, generator=gen).to(dtype)
    decodes = native_decode.build_decode_group(spans, device=q.device)
    assert decodes is not None
    k_flat, v_flat = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)
    calls: dict[str, Callable[[], object]] = {
        "batch_torch": lambda: [_prefix_piece(q[i : i + 1], k_flat, v_flat, s.runs[0]) for i, s in enumerate(spans)],
        "batch_native": lambda: decodes.attend(q, k_cache, v_cache, module=native)}
    best = dict.fromkeys(calls, float("inf"))
    for call in calls.values():
        call()
    for _ in range(ROUNDS):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            best[name] = min(best[name], time.perf_counter() - start)
    return {name: {BATCH: round(seconds * 1e6, 1)} for name, seconds in best.items()}


def _paths(q: torch.Tensor, run: SlotRun, *, block_size: int, native: ModuleType | None
           ) -> dict[str, Callable[[torch.Tensor, torch.Tensor], object]]:
    def flash(k: torch.Tensor, v: torch.Tensor) -> object:
        return _prefix_piece(q, k, v, run)

    def matmul(k: torch.Tensor, v: torch.Tensor) -> object:
        return decode_matmul.attend_matmul(q, k, v, [run], block_size=block_size)

    # The run's slots (from slot 0) as pool blocks, read through a table as in a step.
    length = torch.tensor([run.length], dtype=torch.int32)
    per_block = block_size if run.first_slot == 0 and run.length % block_size == 0 else 1
    table = torch.arange(run.first_slot // per_block, (run.first_slot + run.length) // per_block,
                         dtype=torch.int32).view(1, -1)

    def fused(k: torch.Tensor, v: torch.Tensor) -> object:
        assert native is not None
        return native_decode.paged_decode(q, k.view(-1, per_block, *k.shape[1:]), v.view(-1, per_block, *v.shape[1:]),
                                          table, length, module=native)

    return {"flash": flash, "matmul": matmul, "native": fused}
