"""W8A8's native row passes (engine/quant/w8a8_rows.cpp) against the torch ops they replace, per projection
shape of the bundled model, beside the int8-dot kernel the plan races the W8A8 routes against.

    .venv/bin/python -P benchmarks/w8a8_rows.py [--threads 2] [--rounds 7] [--rows 16,256,512] [--out FILE]

Per shape (a layer's four projections, synthetic weights: a kernel's time depends on the shape, not the
values) and row count, a call of the int8 GEMM route (`int8_matmul`: quantize the rows, `torch._int_mm`,
scale the sums) with the native passes and with the torch ops, and the int8-dot kernel on the same
shape's 4-bit tiles, each the best of a few calls, in turns whose order alternates by round. Per row
count: the layer's four projections summed (ms), native over torch per round (median, range), and each
side over the int8-dot kernel (what the plan's race compares; W8A8 is a route only where it wins).
Both sides give the same bits (the passes' check at load; tests/engine/quant/test_w8a8_rows.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from decodeservice.engine.quant import native, w8a8

sys.path.insert(0, str(Path(__file__).parent))  # `python -P` leaves the script's folder off the path
from dispatches import caps_in_effect, cpu_name
from json_out import emit

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (out, in): qkv, o, gate_up, down


def best_ms(call: Callable[[], object], calls: int = 5) -> float:
    best = float("inf")
    for _ in range(calls):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--rows", default="16,256,512")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    passes, dot = w8a8.rows_extension(), native.int4_dot_extension()
    if passes is None or dot is None:
        raise SystemExit("the native row passes or the int8-dot kernel did not build here: nothing to compare")
    gen = torch.Generator().manual_seed(0)
    layer = []
    for n, k in SHAPES:
        codes, scales = torch.randint(-127, 128, (k, n), dtype=torch.int8, generator=gen), torch.rand(n, generator=gen)
        packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
        scale_zeros = (torch.rand(k // 32, n, 2, generator=gen) * 0.01).to(torch.bfloat16)
        layer.append((codes, scales, native.tile_codes(packed, scale_zeros)))
    natively = w8a8._native_rows

    def route(x_of: Callable[[int], torch.Tensor], side: str) -> float:
        w8a8._native_rows = natively if side == "native" else (lambda x: None)  # type: ignore[assignment]
        total = 0.0
        for i, (codes, scales, tiles) in enumerate(layer):
            x = x_of(i)
            total += best_ms(lambda: native.int4_dot_matmul(x, tiles, module=dot) if side == "int8_dot"  # noqa: B023
                             else w8a8.int8_matmul(x, codes, scales))  # noqa: B023
        return total

    sides = ("native", "torch", "int8_dot")
    times: dict[int, dict[str, list[float]]] = {}
    loads = [os.getloadavg()[0]]
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            xs = [torch.randn(rows, k, generator=gen).bfloat16() for _, k in SHAPES]
            times[rows] = {side: [] for side in sides}
            for r in range(args.rounds + 1):  # round 0 warms up and is dropped
                for side in sides[r % 3:] + sides[: r % 3]:
                    ms = route(xs.__getitem__, side)
                    if r:
                        times[rows][side].append(ms)
            loads.append(os.getloadavg()[0])
    w8a8._native_rows = natively  # type: ignore[assignment]

    def ratio(a: list[float], b: list[float]) -> dict[str, float]:
        per_round = [x / y for x, y in zip(a, b, strict=True)]
        return {"median": round(statistics.median(per_round), 3), "min": round(min(per_round), 3),
                "max": round(max(per_round), 3)}

    results = {str(rows): {"layer_ms_median": {s: round(statistics.median(ms[s]), 3) for s in sides},
                           "native_over_torch": ratio(ms["native"], ms["torch"]),
                           "native_over_int8_dot": ratio(ms["native"], ms["int8_dot"]),
                           "torch_over_int8_dot": ratio(ms["torch"], ms["int8_dot"])}
               for rows, ms in times.items()}
    emit({"cpu": cpu_name(), "cpu_capability": torch.backends.cpu.get_cpu_capability(), "caps": caps_in_effect(),
          "threads": args.threads, "rounds": args.rounds, "shapes_out_in": SHAPES,
          "load_average_1min": {"min": min(loads), "max": max(loads)},
          "command": "benchmarks/w8a8_rows.py " + " ".join(sys.argv[1:]), "results": results}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
