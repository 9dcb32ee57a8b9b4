"""Where a ~490-token prefill's time goes, part by part, for each prompt-row weight route. JSON out.

    .venv/bin/python -P benchmarks/prefill_breakdown.py [--threads 2] [--tokens 490] [--rounds 5]
        [--routes packed,int8] [--kv-cache-dtype auto] [--out FILE]

One engine per route over the bundled model at its defaults (int4 weights, one chunk: the prompt fits
max_num_batched_tokens), taking turns prompt by prompt in rounds so that the machine's load hits every
route alike. Each prompt is one the engine has not seen (no prefix hit), max_tokens=1: the step that
prefills it is timed as a whole (`engine.step`) and in parts, wall time around each call, summed over
the layers, milliseconds per prefill:

- `embed`, `norms` (every RMSNorm, with the residual add that goes with it), `qkv_proj`, `rope`
  (Rotary.rotate), `qkv_split` (the rest of Attention.project: splits and reshapes), `kv_write`
  (`attend` less the backend's read), `attention` (the backend's read of the pool; `paged_decode_kernel`,
  inside it, is the native kernel), `o_proj`, `gate_up_proj`, `down_proj`, `mlp_act` (SiLU and the
  product), `residual` (the forward less its parts: the last layer's add, the final norm's row pick),
  `head` (`compute_logits`: the rows that sample only), `outside_forward` (the step less the forward and
  the head: scheduling, the batch's metadata and the attention plan, sampling, detokenization).

`route`: which copy of the weights every projection's prompt rows run on (engine/quant/prompt_weights.py),
set on every projection after the engine's own plan: `packed` the oneDNN-packed dense copy in the
activations' dtype, `int8` the int8 copy (int8 rows x int8 weights, exact int32 sums), `plan` whatever
the engine's kernel plan chose. Per route the round with the fastest step is kept, and the per-round
ratio of each route's step to the first route's is given as median and range. A route `ROUTE@REV` is
ROUTE with the int8-dot kernel as it was at git revision REV (a kernel's before/after in one run).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from decodeservice.engine import Engine, SamplingParams
from decodeservice.engine import model as model_module
from decodeservice.engine.attention import native_decode
from decodeservice.engine.quant import detect_cpu
from decodeservice.engine.quant.linear import RowPlanned

sys.path.insert(0, str(Path(__file__).parent))  # `python -P` leaves the script's folder off the path
from decode_step_by_context import spent, timed  # one clock of the parts for both studies
from int4_dot_prompt import build_before
from json_out import emit
from long_context import document_tokens


def instrument_model(engine: Engine) -> None:
    """The parts held by this engine's own modules (the class-level ones are wrapped once in main)."""
    model = engine.model
    timed(model.embed_tokens, "forward", "embed")
    for layer in model.decoder_layers():
        timed(layer.self_attn.qkv_proj, "forward", "qkv_proj")
        timed(layer.self_attn.o_proj, "forward", "o_proj")
        timed(layer.mlp.gate_up_proj, "forward", "gate_up_proj")
        timed(layer.mlp.down_proj, "forward", "down_proj")
    timed(engine.runner.attention_backend, "attend", "attention")


def set_prompt_route(engine: Engine, route: str) -> None:
    """Every projection's prompt rows on `route`'s copy (an A/B harness: the engine's plan chooses one).
    `ROUTE@REV`: ROUTE, with every int8-dot call (decode rows too) on int4_dot.cpp as it was at git
    revision REV (the tiles' layout is the same), so a kernel change is timed inside one run.
    `ROUTE/A+B`: ROUTE for the projections named A or B (o_proj, down_proj, ...) only, the plan's for the
    others: e.g. `packed/o_proj+down_proj@REV` is a plan that kept those two on the packed copy."""
    route, _, rev = route.partition("@")
    route, _, names = route.partition("/")
    dot = build_before(rev) if rev else None
    copy = {"int8": "int8", "packed": "packed", "plan": None}.get(route, "none")
    for name, module in list(engine.model.named_modules()):
        if isinstance(module, RowPlanned) and module is not engine.model.lm_head:
            chosen = copy if not names or name.rsplit(".", 1)[-1] in names.split("+") else None
            plan = module.plan if chosen is None else dataclasses.replace(module.plan, prompt_copy=chosen)
            if dot is not None and getattr(plan, "int8_dot", None) is not None:
                plan = dataclasses.replace(plan, int8_dot=dot)
            if plan is not module.plan:  # another plan is another module, on the same weights (RowPlanned.with_plan)
                engine.model.set_submodule(name, module.with_plan(plan))


def prefill_parts(engine: Engine, tokens: list[int]) -> dict[str, float]:
    """Milliseconds by part of the one step that prefills `tokens` (and samples its first token)."""
    engine.add_request(tokens, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    spent.clear()
    start = time.perf_counter()
    outputs = engine.step()
    spent["step"] += time.perf_counter() - start
    assert not engine.has_unfinished_requests() and sum(len(o.new_token_ids) for o in outputs) == 1, \
        "the prompt took more than one step: raise max_num_batched_tokens or shorten --tokens"
    parts = {part: seconds * 1e3 for part, seconds in spent.items()}
    parts["kv_write"] = parts.pop("attend_total") - parts["attention"]
    parts["qkv_split"] = parts.pop("project") - parts["qkv_proj"] - parts["rope"]
    parts["mlp_act"] = parts.pop("mlp") - parts["gate_up_proj"] - parts["down_proj"]
    known = ("embed", "norms", "qkv_proj", "rope", "qkv_split", "kv_write", "attention", "o_proj", "gate_up_proj",
             "down_proj", "mlp_act")
    parts["residual"] = parts["forward"] - sum(parts.get(k, 0.0) for k in known)
    parts["outside_forward"] = parts["step"] - parts["forward"] - parts["head"]
    return {k: round(v, 3) for k, v in parts.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=490)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--routes", default="packed,int8", help="prompt-row weight routes (plan, packed, int8, none; ROUTE/A+B: for projections A and B only; "
                        "ROUTE@REV: int4_dot.cpp at REV), the first the baseline")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    routes = args.routes.split(",")
    engines = {route: Engine.from_pretrained("smollm2-135m", max_model_len=2048, kv_cache_dtype=args.kv_cache_dtype)
               for route in routes}
    for route, engine in engines.items():
        set_prompt_route(engine, route)
        print(f"engine for route {route} built", file=sys.stderr, flush=True)
    timed(model_module.RMSNorm, "forward", "norms")
    timed(model_module.RMSNorm, "add_and_norm", "norms")
    timed(model_module.Rotary, "rotate", "rope")
    timed(model_module.Attention, "project", "project")
    timed(model_module, "attend", "attend_total")
    timed(native_decode, "paged_decode", "paged_decode_kernel")
    timed(native_decode, "paged_decode_int8", "paged_decode_kernel")
    timed(model_module.MLP, "forward", "mlp")
    timed(model_module.LlamaModel, "run_layers", "forward")
    timed(model_module.LlamaModel, "compute_logits", "head")
    for engine in engines.values():
        instrument_model(engine)
        prefill_parts(engine, document_tokens(engine, args.tokens, offset=10**6))  # warm-up
    best: dict[str, dict[str, float]] = {}
    steps: dict[str, list[float]] = {route: [] for route in routes}
    loads = [os.getloadavg()[0]]
    for r in range(args.rounds):
        order = routes if r % 2 == 0 else routes[::-1]
        for route in order:
            engine = engines[route]
            parts = prefill_parts(engine, document_tokens(engine, args.tokens, offset=1000 * (r + 1)))
            steps[route].append(parts["step"])
            if route not in best or parts["step"] < best[route]["step"]:
                best[route] = parts
        loads.append(os.getloadavg()[0])
        print(f"round {r}: {json.dumps({route: steps[route][-1] for route in routes})} ms", file=sys.stderr, flush=True)
    baseline = routes[0]
    ratios = {route: [s / b for s, b in zip(steps[route], steps[baseline], strict=True)] for route in routes[1:]}
    first = engines[baseline]
    result = {
        "tokens": args.tokens, "threads": args.threads, "rounds": args.rounds,
        "cpu": torch.backends.cpu.get_cpu_capability(), "cpu_model": detect_cpu().model_name,
        "weights": first.model.weight_format, "activations": str(first.dtype).removeprefix("torch."),
        "kv": str(first.kv_dtype).removeprefix("torch."),
        "plan_prompt_routes": ({key: p.prompt_route for key, p in first.model.kernel_plan.shapes.items()}
                               if first.model.kernel_plan is not None else None),
        "caps": {k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
                 if k in os.environ},
        "load_average_1min": {"min": min(loads), "max": max(loads), "per_round": loads},
        "ms_per_prefill_best_round": best,
        "step_ms_per_round": steps,
        "step_vs_baseline": {route: {"median": round(statistics.median(r), 3), "min": round(min(r), 3),
                                     "max": round(max(r), 3)} for route, r in ratios.items()},
    }
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
