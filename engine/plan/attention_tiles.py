"""How many rows of a prompt span the native attention kernel computes as one tile, timed on this CPU.

A tile reads each K/V row once for all of its rows (attention/paged_decode.cpp), and a row's result is the
same bits at every height (tests/engine/attention/test_native_tiles.py), so the height is a matter of speed
alone, and the CPU decides it: a taller tile shares each K/V row among more rows, but its scores (rows x
heads x CHUNK fp32) outgrow L1. Where the AVX-512 build holds four keys' K rows in registers across a
tile's rows, 16 rows measured fastest; under the AVX2 dispatch 4 over bf16 pools and 8 over int8 rows
(docs/performance.md). So the engine's plan times the heights on the model's attention shape and pool rows
at start-up and keeps the answer per CPU, dispatch, thread count and kernel build (quant/plan_cache.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from decodeservice.engine.attention import kv_int8, native_decode
from decodeservice.engine.plan.execution import MEASURED_NOW
from decodeservice.engine.quant.cpu import detect_cpu
from decodeservice.engine.quant.plan_cache import plan_cache_path, read_cached, write_cached

CANDIDATES = (1, 2, 4, 8, 16)
# One layer's prompt chunk: rows of lengths 1 .. PROMPT_ROWS, the longest split into two pieces of CHUNK keys.
PROMPT_ROWS = 384
# Another height replaces the kernel's default only where it takes at most this share of its time: a
# start-up timing on a loaded machine moves by several percent, and a wrong pick costs only speed.
WINS = 0.95


@dataclass(frozen=True, kw_only=True)
class TileChoice:
    rows: int
    timings_us: dict[int, float]  # the best of the rounds, per height
    source: str  # MEASURED_NOW, or the cache file it was read from

    def describe(self) -> dict[str, Any]:
        return {"tile_rows": self.rows, "timings_us": {str(k): v for k, v in self.timings_us.items()},
                "source": self.source}


def choose_tile_rows(module: ModuleType, *, heads: int, kv_heads: int, head_dim: int, activations: torch.dtype,
                     kv_int8_rows: bool, rounds: int = 5, cache_dir: Path | None = None) -> TileChoice:
    """The fastest tile height for this model's attention shape and pool rows, from the cache or timed now."""
    shape = f"attention tiles {heads}x{kv_heads}x{head_dim}{' int8 rows' if kv_int8_rows else ''}"
    path = plan_cache_path(cache_dir, detect_cpu(), activations, [shape], prefix="tiles")
    cached = read_cached(path, _parse)
    if cached is not None:
        return TileChoice(rows=cached.rows, timings_us=cached.timings_us, source=str(path))
    timings = time_heights(module, heads=heads, kv_heads=kv_heads, head_dim=head_dim, activations=activations,
                           kv_int8_rows=kv_int8_rows, rounds=rounds)
    fastest = min(timings, key=lambda rows: timings[rows])
    default = native_decode.TILE_ROWS
    rows = fastest if timings[fastest] <= WINS * timings[default] else default
    choice = TileChoice(rows=rows, timings_us=timings, source=MEASURED_NOW)
    write_cached(path, {"rows": rows, "timings_us": {str(k): v for k, v in timings.items()}})
    return choice


def time_heights(module: ModuleType, *, heads: int, kv_heads: int, head_dim: int, activations: torch.dtype,
                 kv_int8_rows: bool, rounds: int) -> dict[int, float]:
    """Microseconds of one layer's PROMPT_ROWS-row chunk at each candidate height, the best of `rounds`
    rounds whose order rotates, on random pools scattered as a used pool's blocks are."""
    gen = torch.Generator().manual_seed(0)
    block = 16
    width = -(-PROMPT_ROWS // block)
    k, v = (torch.randn(width + 4, block, kv_heads, head_dim, generator=gen) for _ in range(2))
    q = torch.randn(PROMPT_ROWS, heads, head_dim, generator=gen).to(activations)
    table = torch.randperm(width + 4, generator=gen)[:width].to(torch.int32)
    tables = table.repeat(PROMPT_ROWS, 1).contiguous()
    lengths = torch.arange(1, PROMPT_ROWS + 1, dtype=torch.int32)
    attend: Callable[..., torch.Tensor]
    if kv_int8_rows:
        k_pool, v_pool = kv_int8.pack_rows(k), kv_int8.pack_rows(v)
        attend = native_decode.paged_decode_int8
    else:
        k_pool, v_pool = k.to(activations), v.to(activations)
        attend = native_decode.paged_decode
    best = {rows: float("inf") for rows in CANDIDATES}
    for r in range(rounds + 1):  # round 0 warms the pools and the kernel up and is dropped
        for rows in CANDIDATES[r % len(CANDIDATES):] + CANDIDATES[: r % len(CANDIDATES)]:
            start = time.perf_counter()
            attend(q, k_pool, v_pool, tables, lengths, module=module, tile_rows=rows)
            if r:
                best[rows] = min(best[rows], (time.perf_counter() - start) * 1e6)
    return {rows: round(us, 1) for rows, us in best.items()}


def _parse(raw: Any) -> TileChoice:
    timings = {int(k): float(v) for k, v in raw["timings_us"].items()}
    rows = int(raw["rows"])
    if rows not in CANDIDATES or set(timings) != set(CANDIDATES):
        raise ValueError(f"tile rows {rows} or heights {sorted(timings)} outside {CANDIDATES}")
    return TileChoice(rows=rows, timings_us=timings, source="")  # the caller names the file
