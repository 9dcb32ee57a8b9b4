"""The int8-dot kernel at decode and prompt sizes, per projection shape: this tree's kernel against an
earlier revision's and against the packed bf16 copy prompt rows may run on. JSON out.

    .venv/bin/python -P benchmarks/int4_dot_prompt.py [--before REV] [--threads 2] [--rows 1,8,32,256,512]
        [--rounds 7] [--out FILE]
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 .venv/bin/python -P \
        benchmarks/int4_dot_prompt.py --out FILE

The bundled model's four projection shapes (q/k/v 960x576, o 576x576, gate/up 3072x576, down
576x1536: out x in), on random 4-bit codes and scales laid out as the engine lays them (native.tile_codes)
and bf16 rows, as the engine's activations are on a CPU with native bf16. Paths:

- `after`: engine/quant/int4_dot.cpp as it is in the tree;
- `before`: the same file at `--before` (built beside it under another name), the baseline;
- `packed_bf16`: the prompt copy (prompt_weights.packed_linear on the dequantized weight, padded to
  ROW_TILE rows as prompt rows call it), timed only from 16 rows (decode rows never take it).

Each round times every path once per shape and row count, interleaved; per path the best (ms) and the
GOPS it means (2 M N K / time), and the per-round ratios after/before and after/packed_bf16 as median
and range. Both kernels' results are checked equal row for row to each other's tolerance (relative
error against the fp32 product) and `after` is checked bit for bit against itself at one row.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))  # `python -P` leaves the script's folder off the path
from json_out import emit

SHAPES = {"qkv_proj": (960, 576), "o_proj": (576, 576), "gate_up_proj": (3072, 576), "down_proj": (576, 1536)}
# The kernel before its prompt-size tiles (the tree's revision when this benchmark was written).
BEFORE = "6fd3a5d"
REPO = Path(__file__).resolve().parent.parent


def build_before(rev: str) -> Any:
    """int4_dot.cpp at `rev`, built and self-checked as the engine builds its own (another file name, so
    another extension name and cache entry)."""
    from decodeservice.engine.cpp_extensions import build_extension
    from decodeservice.engine.quant import native

    code = subprocess.run(["git", "show", f"{rev}:engine/quant/int4_dot.cpp"], cwd=REPO, check=True,
                          capture_output=True).stdout
    source = Path(tempfile.mkdtemp()) / f"int4_dot_at_{rev}.cpp"
    source.write_bytes(code)
    return build_extension(source, what=f"int8-dot at {rev}", check=native._dot_agrees, x86_intrinsics=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", default=BEFORE, help="git revision of the baseline kernel")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,8,32,256,512")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from decodeservice.engine.quant import detect_cpu, prompt_weights
    from decodeservice.engine.quant.native import (
        _reference_weight,
        int4_dot_extension,
        int4_dot_matmul,
        tile_codes,
    )
    from decodeservice.engine.quant.step_rows import ROW_TILE, tiled_linear

    after, before = int4_dot_extension(), build_before(args.before)
    if after is None or before is None:
        print("no int8-dot kernel here (it needs AVX2 and a C++ compiler)", file=sys.stderr)
        return 2
    packing = prompt_weights.supported(torch.bfloat16)
    rows_list = [int(r) for r in args.rows.split(",")]
    gen = torch.Generator().manual_seed(0)
    cases: dict[tuple[str, int], dict[str, Callable[[], object]]] = {}
    checks: dict[str, Any] = {}
    for name, (n, k) in SHAPES.items():
        codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
        scale_zeros = torch.stack([torch.rand(k // 32, n, generator=gen) * 0.02 + 0.005,
                                   torch.randn(k // 32, n, generator=gen) * 0.01], dim=-1).to(torch.bfloat16)
        tiles, weight = tile_codes(codes, scale_zeros), _reference_weight(codes, scale_zeros)
        packed = prompt_weights.packed_linear(weight.bfloat16()) if packing else None
        x_all = torch.randn(max(rows_list), k, generator=gen).bfloat16()
        with torch.inference_mode():
            reference = x_all.float() @ weight.t()
            new, old = (int4_dot_matmul(x_all, tiles, module=m).float() for m in (after, before))
            one = torch.cat([int4_dot_matmul(x_all[i:i + 1], tiles, module=after) for i in range(5)]).float()
        checks[name] = {"after_rel_error": _rel(new, reference), "before_rel_error": _rel(old, reference),
                        "after_vs_before_rel": _rel(new, old), "after_row_invariant": bool(torch.equal(one, new[:5]))}
        for rows in rows_list:
            x = x_all[:rows].contiguous()
            paths: dict[str, Callable[[], object]] = {
                "before": lambda x=x, t=tiles: int4_dot_matmul(x, t, module=before),
                "after": lambda x=x, t=tiles: int4_dot_matmul(x, t, module=after)}
            if packed is not None and rows >= ROW_TILE:
                paths["packed_bf16"] = lambda x=x, p=packed: tiled_linear(x, p)
            cases[(name, rows)] = paths

    times: dict[tuple[str, int], dict[str, list[float]]] = {c: {p: [] for p in ps} for c, ps in cases.items()}
    with torch.inference_mode():
        for paths in cases.values():
            for fn in paths.values():
                fn()  # warm: allocation, oneDNN's primitive
        for _ in range(args.rounds):
            for case, paths in cases.items():
                for path, fn in paths.items():
                    times[case][path].append(_best_ms(fn))

    results: dict[str, Any] = {}
    for (name, rows), per_path in times.items():
        n, k = SHAPES[name]
        entry: dict[str, Any] = {"ms": {p: round(min(t), 4) for p, t in per_path.items()},
                                 "gops": {p: round(2 * rows * n * k / min(t) / 1e6, 1) for p, t in per_path.items()}}
        for other in ("before", "packed_bf16"):
            if other in per_path:
                ratios = [a / b for a, b in zip(per_path["after"], per_path[other], strict=True)]
                entry[f"after_vs_{other}"] = {"median": round(statistics.median(ratios), 3),
                                              "range": [round(min(ratios), 3), round(max(ratios), 3)]}
        results.setdefault(name, {})[str(rows)] = entry
        print(name, rows, entry, file=sys.stderr)
    emit({"cpu": detect_cpu().describe(), "aten": torch.backends.cpu.get_cpu_capability(),
          "caps": {v: os.environ[v] for v in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA",
                                              "MKL_ENABLE_INSTRUCTIONS") if v in os.environ},
          "vnni": {"after": bool(after.uses_vnni()), "before": bool(before.uses_vnni())},
          "threads": args.threads, "rounds": args.rounds, "before": args.before, "torch": torch.__version__,
          "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_average": _load(),
          "checks": checks, "results": results}, args.out)
    return 0


def _best_ms(fn: Callable[[], object], *, budget_s: float = 0.05, most: int = 50) -> float:
    """Best of at least 3 runs, more while within `budget_s` (a time slice on a shared machine hits some)."""
    best, runs, started = float("inf"), 0, time.perf_counter()
    while runs < 3 or (runs < most and time.perf_counter() - started < budget_s):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
        runs += 1
    return best * 1e3


def _rel(value: torch.Tensor, reference: torch.Tensor) -> float:
    return round(float((value - reference).norm() / reference.norm()), 5)


def _load() -> list[float]:
    return [round(v, 2) for v in os.getloadavg()]


if __name__ == "__main__":
    raise SystemExit(main())
