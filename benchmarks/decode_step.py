"""Where one decode step goes, and what each projection costs as the batch grows. JSON out.

    .venv/bin/python -P benchmarks/decode_step.py [--quantization int4] [--threads 1,2] [--streams 32] [--compile] [--out FILE]

- `profile`: per thread count and per batch (1 stream, then `--streams` streams), the median wall time
  of a decode step (unprofiled) and torch.profiler's breakdown of the same steps: time by kind (the
  projections' kernels, the attention kernel, the KV write, every other op), the time outside any op
  (Python: scheduler, batch building, sampling, the per-layer glue; estimated), and the top ops.
- `projection_rows`: one layer's projections and the head, timed at M = 1..64 rows with the engine's
  int4 kernel, int8 (`_weight_int8pack_mm`), W8A8 (`torch._int_mm` on int8 codes, the activations'
  per-row quantization and the int32 epilogue included: engine/quant/w8a8.py, which takes it from
  `W8A8_ROWS` rows on), bf16 `F.linear` on the dequantized weight, and what dequantizing the int4 weight
  costs (the reference `Int4Linear` falls back to where its weight-only kernel fails the self-check).
  Weights stay in cache between repeats here, so these are the kernels' compute, not DRAM streaming.
- `verify_row_cost`: a speculative verify's step time with k drafts against the 1-row step, per row
  (what `SpeculativeConfig.draft_row_cost` should be), at the first thread count.

engine_vs_peers.py puts `profile` into its output for the profiled precision.

With `--compile` (EngineConfig.compile) decode steps run as one inductor graph: its projections and fused
kernels are made from generated C++ the profiler does not see op by op, so they show as one kind,
`compiled_graph`; the attention op's own Python (around the flash kernel) is `attention_glue`.
`projection_rows` is left out there (the kernels are the eager ones).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))  # `python -P` leaves the script's folder off the path
from json_out import emit

MATMUL_OPS = ("_weight_int4pack_mm", "_weight_int8pack_mm", "_int_mm", "mkldnn", "aten::mm", "aten::addmm",
              "aten::linear")
ATTENTION_OPS = ("scaled_dot_product", "flash_attention")


def _kind(op: str) -> str:
    if "CompiledFxGraph" in op:
        return "compiled_graph"
    if "decodeservice::paged_attention" in op:
        return "attention_glue"
    if any(m in op for m in MATMUL_OPS):
        return "projections"
    if any(m in op for m in ATTENTION_OPS):
        return "attention_kernel"
    if "index_copy" in op:
        return "kv_write"
    return "other_ops"


def profile_steps(engine: Any, prompt: str, *, streams: int, steps: int = 8) -> dict[str, Any]:
    """`streams` concurrent decodes of `prompt`: step time and its breakdown, per step."""
    from torch.profiler import ProfilerActivity, profile

    from decodeservice.engine import SamplingParams

    params = SamplingParams(max_tokens=2 * steps + 8, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(f"{i}: {prompt}", params) for i in range(streams)]
    started: set[str] = set()
    while len(started) < streams:  # prefill until every stream decodes
        started.update(o.request_id for o in engine.step() if o.new_token_ids)
    engine.step()
    walls = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        walls.append((time.perf_counter() - t0) * 1000)
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    profiled_ms = (time.perf_counter() - start) * 1000 / steps
    for request_id in ids:
        engine.abort_request(request_id)
    events = prof.key_averages()
    by_kind: dict[str, float] = {}
    for e in events:
        by_kind[_kind(e.key)] = by_kind.get(_kind(e.key), 0.0) + e.self_cpu_time_total / 1000 / steps
    wall = statistics.median(walls)
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:10]
    return {
        "streams": streams,
        "wall_ms_per_step": round(wall, 2),
        "wall_ms_per_step_profiled": round(profiled_ms, 2),
        "ms_per_step_by_kind": {k: round(v, 2) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        # Python around the ops (scheduler, batch building, sampling, per-layer glue). An estimate: the
        # profiler inflates each op's own time a little, so this errs low.
        "outside_ops_ms_estimate": round(max(wall - sum(by_kind.values()), 0.0), 2),
        "top_ops": {e.key: {"ms_per_step": round(e.self_cpu_time_total / 1000 / steps, 3),
                            "calls_per_step": e.count // steps} for e in top},
    }


def profile(engine: Any, prompt: str, *, threads: list[int], streams: int) -> dict[str, Any]:
    """The step at 1 stream and at `streams`, for each thread count; the thread count is restored."""
    import torch

    before = torch.get_num_threads()
    out: dict[str, Any] = {}
    try:
        for n in threads:
            torch.set_num_threads(n)
            out[f"{n}_threads"] = {f"batch_{s}": profile_steps(engine, prompt, streams=s) for s in (1, streams)}
    finally:
        torch.set_num_threads(before)
    return out


def verify_row_cost(engine: Any, prompt: str, *, drafts: tuple[int, ...] = (1, 2, 4, 8), rounds: int = 12
                    ) -> dict[str, Any]:
    """What verifying k drafts costs one sequence: the forward + logits of 1 + k rows against 1 row.

    Timed the way the runner runs a verify (one sequence, k draft tokens after its last token), the
    k = 0 step interleaved with every k so the machine's load hits both alike; min over rounds.
    `draft_row_cost` in SpeculativeConfig is the cost of one more row as a fraction of the 1-row step."""
    from decodeservice.engine import SamplingParams
    from decodeservice.engine.scheduler import ScheduledSequence, SchedulerPlan

    request_id = engine.add_request(prompt, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    seq = engine._requests[request_id]
    while not seq.output_token_ids:
        engine.step()
    assert engine.kv.allocate_slots(seq, 1 + max(drafts))
    seq.spec_token_ids = seq.prompt_token_ids[: max(drafts)]  # any tokens: only the cost is measured

    def once(k: int) -> float:
        plan = SchedulerPlan(scheduled=[ScheduledSequence(seq=seq, num_new_tokens=1 + k, num_spec_tokens=k)])
        t0 = time.perf_counter()
        engine.runner.execute(plan)
        return (time.perf_counter() - t0) * 1000

    samples: dict[int, list[float]] = {k: [] for k in (0, *drafts)}
    once(0)
    for _ in range(rounds):
        for k in drafts:
            samples[0].append(once(0))
            samples[k].append(once(k))
    seq.spec_token_ids = []
    engine.abort_request(request_id)
    base = min(samples[0])
    return {"step_ms_by_drafts": {str(k): round(min(v), 2) for k, v in samples.items()},
            "row_cost_by_drafts": {str(k): round((min(samples[k]) - base) / (k * base), 3) for k in drafts}}


def _time_ms(fn: Callable[[], object], reps: int) -> float:
    fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1000)
    return round(min(samples), 4)  # min: the machine is shared, and the kernel's own cost is the floor


def projection_rows(model: Any, rows: tuple[int, ...] = (1, 2, 4, 6, 8, 16, 32, 64)) -> dict[str, Any]:
    """Layer 0's projections and the head of an int4 model, per kernel and row count (ms, min of repeats)."""
    import torch
    import torch.nn.functional as F

    from decodeservice.engine.quant.linear import Int4Linear, Int8Linear
    from decodeservice.engine.quant.w8a8 import w8a8_mm

    layer = model.decoder_layers()[0]
    modules = {"qkv": layer.self_attn.qkv_proj, "o": layer.self_attn.o_proj, "gate_up": layer.mlp.gate_up_proj,
               "down": layer.mlp.down_proj, "head": model.lm_head}
    out: dict[str, Any] = {}
    gen = torch.Generator().manual_seed(0)
    for name, module in modules.items():
        assert isinstance(module, Int4Linear), "projection_rows needs the int4 model"
        reps = 3 if name == "head" else 15
        dense = module.dense_weight(torch.bfloat16)  # (N, K) bf16, from our own codes
        int8 = Int8Linear(dense.float())
        int8_scales = int8.scales.float()
        per_m: dict[str, Any] = {}
        for m in rows:
            x = torch.randn(m, module.in_features, generator=gen).to(dense.dtype)
            per_m[f"M={m}"] = {
                "int4": _time_ms(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(
                    x, module.torch_packing(), module.group_size, module.scale_zeros), reps),  # noqa: B023
                "int8": _time_ms(lambda: torch.ops.aten._weight_int8pack_mm(
                    x, int8.weight_int8, int8.scales), reps),  # noqa: B023
                "w8a8": _time_ms(lambda: w8a8_mm(x, int8.weight_int8, int8_scales), reps),  # noqa: B023
                "bf16": _time_ms(lambda: F.linear(x, dense), reps),  # noqa: B023
            }
        out[name] = {"shape": [module.out_features, module.in_features],
                     "dequantize_int4_ms": _time_ms(lambda: module.dense_weight(torch.bfloat16),  # noqa: B023
                                                       2 if name == "head" else 5), **per_m}
    return out


def main() -> int:
    import torch

    from decodeservice.engine import Engine

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quantization", default="int4", choices=["none", "int8", "int4"])
    parser.add_argument("--threads", default="1,2", help="thread counts to profile, comma-separated")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--w8a8", action=argparse.BooleanOptionalAction, default=True,
                        help="EngineConfig.w8a8 for the profiled engine (default on)")
    parser.add_argument("--compile", action="store_true", help="EngineConfig.compile (the decode step as one graph)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    torch.set_num_threads(threads[0])
    engine = Engine.from_pretrained("smollm2-135m", quantization=args.quantization, enable_prefix_caching=False,
                                    max_num_seqs=64, max_model_len=2048, kv_cache_gib=0.15, w8a8=args.w8a8,
                                    compile=args.compile)
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Tell me about the moon."}])
    report: dict[str, Any] = {"quantization": engine.model.weight_format, "w8a8": args.w8a8, "compile": args.compile,
                              "profile": profile(engine, prompt, threads=threads, streams=args.streams)}
    report["verify_row_cost"] = verify_row_cost(engine, prompt)
    if engine.model.weight_format == "int4" and not args.compile:
        report["projection_rows"] = {f"{threads[0]}_threads": projection_rows(engine.model)}
    emit(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
