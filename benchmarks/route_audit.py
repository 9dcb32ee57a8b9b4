"""Every route the engine can take for attention and for a quantized projection, timed against the plain
path it replaces, on the bundled model's shapes, per CPU dispatch in one run. JSON out.

    .venv/bin/python -P benchmarks/route_audit.py [--dispatch native,avx2] [--rounds 5] [--out FILE]

Attention (route_audit_attention.py): the native paged kernel (decodes, prompt rows) against the CPU
backend's plain path (gather + SDPA); 1, 4 and 16 decode rows over 64 to 2600 keys, 16 to 512 prompt rows
with and without a cached prefix. `--routes native_kernel_decode` times the decodes alone.
Projections (one layer's, in model order, as a step streams them; the head on its own): torch's int4
weight-only kernel against the int8-dot kernel; the plan's weight-only kernel against the packed prompt
copy, the reference (dequantize per call, then a GEMM: `dense_dequantized`, a route until it lost here at
every row count, kept to show it still loses) and W8A8; Int8Linear's routes (from the same weights); at
1, 4, 16 decode rows and 16 to 512 prompt rows.

Each round times every case's route and reference in turn (order alternating by round), each as the
best of as many calls as fit in `--budget-ms` (at least 3); a case's speedup is reference / route per
round, reported as the median and range over rounds, beside the ratio of the bests over all rounds
(`speedup_of_bests`, what time slices on a loaded machine disturb least). Per route: where this dispatch's
default plan (the engine as `decodectl engine` builds it) takes it, and `earns_place`: a median speedup of
at least 1.2x on a shape the plan gives it. The load average is recorded before and after each dispatch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))  # `python -P` leaves the script's folder off the path

from dispatches import caps_in_effect, report, run_child
from route_audit_attention import Case

ROOT = Path(__file__).resolve().parent.parent
WINS = 1.2  # the speedup a route must show over the path it replaces to keep its place
DECODE_ROWS = (1, 4, 16)
PROMPT_ROWS = (16, 64, 256, 512)


def best_ms(fn: Callable[[], object], budget_ms: float) -> float:
    fn()  # warm: oneDNN builds a primitive per shape at its first call
    best, runs, started = float("inf"), 0, time.perf_counter()
    while runs < 3 or (runs < 500 and (time.perf_counter() - started) * 1e3 < budget_ms):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
        runs += 1
    return best * 1e3


def linear_cases(engine: Any, *, dtype: torch.dtype, gen: torch.Generator) -> list[Case]:
    from decodeservice.engine.quant.linear import Int4Linear, Int8Linear, RowPlanned
    from decodeservice.engine.quant.native import int4_dot_extension, int4_dot_matmul, tile_codes
    from decodeservice.engine.quant.prompt_weights import supported
    from decodeservice.engine.quant.step_rows import tiled_linear
    from decodeservice.engine.quant.w8a8 import quantize_int8, w8a8_mm

    named = [(n, m) for n, m in engine.model.named_modules() if isinstance(m, RowPlanned)]
    layer = [m for n, m in named if n.split("layers.")[-1].startswith("0.") and isinstance(m, Int4Linear)]
    heads = [m for n, m in named if n.endswith("lm_head") and isinstance(m, Int4Linear)]
    if not layer:
        return []
    dot = int4_dot_extension()
    tiles = {id(m): tile_codes(m.codes, m.scale_zeros) for m in layer + heads if m.int8_dot_fits and dot is not None}
    dense = {id(m): m.dense_weight(torch.float32) for m in layer}
    int8 = {id(m): Int8Linear(dense[id(m)], dtype=dtype, w8a8=True) for m in layer}
    w8a8 = {id(m): quantize_int8(dense[id(m)]) for m in layer}
    packed = ({id(m): torch.ops.mkldnn._reorder_linear_weight(m.dense_weight(dtype), None) for m in layer}
              if supported(dtype) else {})
    out: list[Case] = []

    def rows_of(modules: list[Int4Linear], rows: int) -> dict[int, torch.Tensor]:
        return {m.in_features: torch.randn(rows, m.in_features, generator=gen).to(dtype) for m in modules}

    def each(modules: list[Int4Linear], rows: int, call: Callable[[Int4Linear, torch.Tensor], object]) -> Callable[[], object]:
        x = rows_of(modules, rows)
        return lambda: [call(m, x[m.in_features]) for m in modules]

    def torch_int4(m: Int4Linear, x: torch.Tensor) -> object:
        return m.torch_weight_only(x.to(torch.bfloat16)).to(dtype)

    def case(route: str, reference: str, shape: str, run: Callable[[], object], plain: Callable[[], object]) -> None:
        out.append(Case(route=route, reference=reference, shape=shape, run=run, plain=plain))

    if tiles:
        for what, modules in (("layer", [m for m in layer if id(m) in tiles]), ("head", [m for m in heads if id(m) in tiles])):
            for rows in DECODE_ROWS:
                case("int8_dot", "torch_int4", f"{what} x {rows} rows",
                     each(modules, rows, lambda m, x: int4_dot_matmul(x, tiles[id(m)], module=dot)),
                     each(modules, rows, torch_int4))
    for rows in PROMPT_ROWS:
        case("dense_dequantized", "weight_only", f"layer x {rows} rows",
             each(layer, rows, lambda m, x: F.linear(x, m.dense_weight(dtype))), each(layer, rows, lambda m, x: m.weight_only_rows(x)))
        if packed:
            case("packed_prompt_copy", "weight_only", f"layer x {rows} rows",
                 each(layer, rows, lambda m, x: tiled_linear(x, _packed_linear(packed[id(m)]))),
                 each(layer, rows, lambda m, x: m.weight_only_rows(x)))
    for rows in (4, 16, 64):
        case("w8a8_int4", "weight_only", f"layer x {rows} rows",
             each(layer, rows, lambda m, x: w8a8_mm(x, w8a8[id(m)][0], w8a8[id(m)][1])),
             each(layer, rows, lambda m, x: m.weight_only_rows(x)))
    for rows in DECODE_ROWS:
        case("int8_weight_only", "int8_dense", f"layer x {rows} rows",
             each(layer, rows, lambda m, x: int8[id(m)].weight_only_rows(x)),
             each(layer, rows, lambda m, x: F.linear(x, int8[id(m)].dense_weight(dtype))))
    for rows in (16, 64):
        case("int8_w8a8", "int8_weight_only", f"layer x {rows} rows",
             each(layer, rows, lambda m, x: int8[id(m)].w8a8(x)), each(layer, rows, lambda m, x: int8[id(m)].weight_only_rows(x)))
    for rows in (256, 512):
        case("int8_dense", "int8_weight_only", f"layer x {rows} rows",
             each(layer, rows, lambda m, x: F.linear(x, int8[id(m)].dense_weight(dtype))),
             each(layer, rows, lambda m, x: int8[id(m)].weight_only_rows(x)))
    return out


def _packed_linear(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    def linear(rows: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(rows, weight, None, "none", [], "")
        return out

    return linear


def plan_uses(engine: Any) -> dict[str, str]:
    """Where this engine's default plan takes each route ('' where it never does, on this machine)."""
    from decodeservice.engine.plan import CpuAttentionPlan

    attention = engine.plan.attention
    cpu = attention if isinstance(attention, CpuAttentionPlan) else None
    native = cpu is not None and cpu.kernel is not None
    plan = engine.model.kernel_plan.describe() if engine.model.kernel_plan is not None else {"rows": {}}
    rows = plan["rows"]
    dot = [k for k, p in rows.items() if p["weight_only"].startswith("int8 dot")]
    copies = [k for k, p in rows.items() if p["prompt_packed"]]
    uses = {
        "native_kernel_decode": "every decode and verify (up to 9 rows a span)" if native else "",
        "native_kernel_prompt": "every prompt row (a prefix hit computes what the miss did)" if native else "",
        "int8_dot": f"weight-only calls of {', '.join(dot)}" if dot else "",
        "dense_dequantized": "",  # removed: only the self-check's fallback, where a weight-only kernel fails it
        "packed_prompt_copy": f"prompt rows of {', '.join(copies)}" if copies else "",
        "w8a8_int4": "", "int8_weight_only": "", "int8_w8a8": "", "int8_dense": "",  # non-default options (--w8a8, int8)
    }
    return uses


def child(args: argparse.Namespace) -> None:
    import route_audit_attention

    from decodeservice.engine import Engine
    from decodeservice.engine.attention import native_decode
    from decodeservice.engine.quant import detect_cpu

    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    engine = Engine.from_pretrained("smollm2-135m", kv_cache_gib=0.05, max_model_len=1024)
    gen = torch.Generator().manual_seed(0)
    kernel = native_decode.decode_extension() if native_decode.applies(engine.dtype, 64) else None
    with torch.inference_mode():
        all_cases = route_audit_attention.cases(dtype=engine.dtype, kv_dtype=engine.plan.kv.dtype, kernel=kernel, gen=gen)
        all_cases += linear_cases(engine, dtype=engine.dtype, gen=gen)
        if args.routes:
            all_cases = [c for c in all_cases if c.route in args.routes.split(",")]
        ratios: dict[int, list[float]] = {i: [] for i in range(len(all_cases))}
        times: dict[int, list[tuple[float, float]]] = {i: [] for i in range(len(all_cases))}
        for r in range(args.rounds):
            for i, c in enumerate(all_cases):
                pair = (c.run, c.plain) if r % 2 == 0 else (c.plain, c.run)
                first, second = best_ms(pair[0], args.budget_ms), best_ms(pair[1], args.budget_ms)
                route_ms, plain_ms = (first, second) if r % 2 == 0 else (second, first)
                ratios[i].append(plain_ms / route_ms)
                times[i].append((route_ms, plain_ms))
            print(f"round {r + 1}/{args.rounds} done, load {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
    uses = plan_uses(engine)
    routes: dict[str, Any] = {}
    for i, c in enumerate(all_cases):
        entry = routes.setdefault(c.route, {"replaces": c.reference, "plan_uses_here": uses.get(c.route, ""), "shapes": {}})
        entry["shapes"][c.shape] = {
            "speedup_median": round(statistics.median(ratios[i]), 3),
            "speedup_range": [round(min(ratios[i]), 3), round(max(ratios[i]), 3)],
            "route_ms_best": round(min(t[0] for t in times[i]), 4), "reference_ms_best": round(min(t[1] for t in times[i]), 4)}
        # The best of every round on either side: what a loaded machine's time slices disturb least.
        entry["shapes"][c.shape]["speedup_of_bests"] = round(min(t[1] for t in times[i]) / min(t[0] for t in times[i]), 3)
    for entry in routes.values():
        medians = [s["speedup_median"] for s in entry["shapes"].values()]
        entry["best_median"], entry["worst_median"] = max(medians), min(medians)
        entry["wins_1_2x"] = max(medians) >= WINS
        entry["earns_place"] = bool(entry["plan_uses_here"]) and max(medians) >= WINS
    report({"cpu": detect_cpu().describe(), "caps": caps_in_effect(), "threads": args.threads,
            "activations": str(engine.dtype), "kv_cache": str(engine.plan.kv.dtype),
            "attention_plan": engine.plan.attention.why,
            "kernel_plan": engine.model.kernel_plan.describe()["rows"] if engine.model.kernel_plan is not None else None,
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()], "routes": routes})


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--dispatch", default="native,avx2", help="native, avx2 or both (comma-separated)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--budget-ms", type=float, default=15.0, help="time per path per round (best of the calls)")
    parser.add_argument("--routes", default="", help="only these routes (comma-separated; default: every route)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    results: dict[str, Any] = {"command": " ".join(sys.argv[1:]), "wins": WINS, "uptime": os.popen("uptime").read().strip()}
    for dispatch in args.dispatch.split(","):
        results[dispatch] = run_child(__file__, dispatch, sys.argv[1:], cwd=ROOT)
    dispatches = [d for d in args.dispatch.split(",") if d in results]
    names = sorted({r for d in dispatches for r in results[d]["routes"]})
    results["summary"] = {name: {
        "earns_place": any(results[d]["routes"].get(name, {}).get("earns_place", False) for d in dispatches),
        **{d: {k: results[d]["routes"][name][k] for k in ("plan_uses_here", "best_median", "worst_median", "wins_1_2x")}
           for d in dispatches if name in results[d]["routes"]}} for name in names}
    text = json.dumps(results, indent=1)
    print(json.dumps(results["summary"], indent=1))
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
