"""The bundled model's 4-bit projections: torch's weight-only kernel vs the int8-dot kernel. JSON out.

    .venv/bin/python -P benchmarks/int4_kernels.py [--threads 1] [--rows 1,4,8,16,32] [--out FILE]
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 .venv/bin/python -P benchmarks/int4_kernels.py

Every projection of every layer (the head apart: it is timed on its own) run in model order, as a
decode step streams them, once through `_weight_int4pack_mm_for_cpu` and once through native.py's
int8-dot kernel, both on bf16 rows as the engine calls them (RowPlanned.forward), the two interleaved
for `--rounds` rounds; best per path and row count, and the ratio.
The second command is how an AVX-512 machine measures the AVX2 build (torch's int4 kernel takes its
AVX2 path under the cap too). Each path's relative error against the fp32 product on the same codes is
recorded beside its time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", default="1,4,8,16,32")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from decodeservice.engine import Engine
    from decodeservice.engine.quant.cpu import detect_cpu
    from decodeservice.engine.quant.linear import Int4Linear
    from decodeservice.engine.quant.native import int4_dot_extension, int4_dot_matmul, tile_codes

    dot = int4_dot_extension()
    if dot is None:
        print("no int8-dot kernel here (it needs AVX2 and a C++ compiler)", file=sys.stderr)
        return 2
    engine = Engine.from_pretrained("smollm2-135m", quantization="int4", kv_cache_gib=0.05, max_model_len=1024)
    named = [(n, m) for n, m in engine.model.named_modules() if isinstance(m, Int4Linear)]
    layers = [(m, tile_codes(m.codes, m.scale_zeros)) for n, m in named if not n.endswith("lm_head")]
    heads = [(m, tile_codes(m.codes, m.scale_zeros)) for n, m in named if n.endswith("lm_head")]
    dtype = engine.dtype  # the engine's activations (recorded): the kernels get bf16 rows either way
    gen = torch.Generator().manual_seed(0)

    def paths(modules: list[tuple[Int4Linear, Any]], rows: int) -> dict[str, Callable[[], object]]:
        inputs = {m.in_features: torch.randn(rows, m.in_features, generator=gen) for m, _ in modules}
        return {
            "torch_int4": lambda: [m.torch_weight_only(inputs[m.in_features].bfloat16()) for m, _ in modules],
            "int8_dot": lambda: [int4_dot_matmul(inputs[m.in_features].bfloat16(), t, module=dot) for m, t in modules],
        }

    results: dict[str, Any] = {}
    with torch.inference_mode():
        errors = _errors(layers[2], int4_dot_matmul, dot)
        for label, modules in (("layers", layers), ("head", heads)):
            results[label] = {}
            for rows in (int(r) for r in args.rows.split(",")):
                timed = paths(modules, rows)
                best = {name: float("inf") for name in timed}
                for fn in timed.values():
                    fn()  # warm
                for _ in range(args.rounds):
                    for name, fn in timed.items():
                        start = time.perf_counter()
                        fn()
                        best[name] = min(best[name], (time.perf_counter() - start) * 1e3)
                results[label][str(rows)] = {"ms": {k: round(v, 3) for k, v in best.items()},
                                             "int8_dot_vs_torch": round(best["int8_dot"] / best["torch_int4"], 3)}
                print(label, rows, results[label][str(rows)], file=sys.stderr)
    report = {"cpu": detect_cpu().describe(), "aten": torch.backends.cpu.get_cpu_capability(),
              "int8_dot_vnni": bool(dot.uses_vnni()), "threads": args.threads, "torch": torch.__version__,
              "activations": str(dtype).removeprefix("torch."), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "projections": len(layers), "relative_error_vs_fp32": errors, "results": results}
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0


def _errors(pair: tuple[Any, Any], matmul: Callable[..., torch.Tensor], dot: Any) -> dict[str, float]:
    module, tiles = pair
    x = torch.randn(8, module.in_features, generator=torch.Generator().manual_seed(1))
    reference = x @ module.dense_weight(torch.float32).t()

    def error(value: torch.Tensor) -> float:
        return round(float((value.float() - reference).norm() / reference.norm()), 5)

    return {"torch_int4": error(module.torch_weight_only(x.bfloat16())), "int8_dot": error(matmul(x.bfloat16(), tiles, module=dot))}


if __name__ == "__main__":
    raise SystemExit(main())
