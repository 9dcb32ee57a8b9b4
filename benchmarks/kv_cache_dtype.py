"""The KV pool in the activations' dtype against int8 rows: two engines side by side in one run, taking
turns. JSON out.

    .venv/bin/python -P benchmarks/kv_cache_dtype.py [--threads 2] [--contexts 8,512,2600] [--rounds 3] [--out FILE]

Both engines share one load of the bundled model at the engine's defaults (int4 weights, activations by
machine) but the KV pool: `activations` holds rows in the activations' dtype (bf16, or fp32 on a CPU
without native bf16), `int8` holds kv_int8.py's rows. `auto_takes` records which of the two
kv_cache_dtype auto takes on this machine (engine/plan/planner.py: plan_kv). Per round and context, each engine in turn serves a prompt it has not seen (a miss: every round's document differs)
and decodes --decode-tokens greedily. Reported per context and engine: TTFT and decode tokens/s, best
and median over the rounds (interference only slows a run down, so best is the cleaner figure), and
int8's ratio to activations; the longest context's decode rate over the shortest's, best over best and
per round (the median of the rounds' ratios); per engine: the pool's bytes per token and how many tokens the same kv_cache_gib
holds. One run on a shared machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from decodeservice.engine import Engine
from decodeservice.engine.config import EngineConfig
from decodeservice.engine.quant import detect_cpu
from decodeservice.engine.runner import kv_bytes_per_block

sys.path.insert(0, str(Path(__file__).parent))  # `python -P` leaves the script's folder off the path
from json_out import emit
from long_context import document_tokens, engine_clocks

KINDS = ("activations", "int8")


def summary(runs: list[dict[str, float]]) -> dict[str, float]:
    ttft, rate = [r["ttft_s"] for r in runs], [r["decode_tokens_per_s"] for r in runs]
    return {"ttft_s_best": min(ttft), "ttft_s_median": statistics.median(ttft),
            "decode_tokens_per_s_best": max(rate), "decode_tokens_per_s_median": statistics.median(rate)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--contexts", default="8,512,2600")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--kv-cache-gib", type=float, default=1.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    contexts = [int(c) for c in args.contexts.split(",")]
    max_len = max(contexts) + args.decode_tokens + 64
    int8 = Engine.from_pretrained("smollm2-135m", max_model_len=max_len, kv_cache_gib=args.kv_cache_gib,
                                  kv_cache_dtype="int8")
    # The activations' dtype asked for by name: its own pool, even where auto would take int8 rows.
    activations = str(int8.dtype).removeprefix("torch.")
    shared = {"max_model_len": max_len, "kv_cache_gib": args.kv_cache_gib}
    engines = {"activations": Engine(model=int8.model, tokenizer=int8.tokenizer,
                                     config=EngineConfig(**shared, dtype=activations)), "int8": int8}
    auto = Engine(model=int8.model, tokenizer=int8.tokenizer, config=EngineConfig(**shared))
    auto_takes = "int8" if auto.kv_dtype == torch.int8 else "activations"
    del auto
    for engine in engines.values():
        engine_clocks(engine, document_tokens(engine, 16, offset=10**6), 4)  # warm-up
    reference = engines["activations"]
    result: dict[str, Any] = {
        "threads": args.threads, "decode_tokens": args.decode_tokens, "rounds": args.rounds,
        "weights": reference.model.weight_format, "activations": str(reference.dtype).removeprefix("torch."),
        "cpu": torch.backends.cpu.get_cpu_capability(), "cpu_model": detect_cpu().model_name,
        "auto_takes": auto_takes, "load_average_1min_at_start": os.getloadavg()[0],
        "pool": {kind: {"dtype": str(e.kv_dtype).removeprefix("torch."),
                        "bytes_per_token": kv_bytes_per_block(e.model_config, 1, e.kv_dtype, e.model_config.num_layers),
                        "tokens_in_kv_cache_gib": e.kv.num_blocks * e.config.block_size}
                 for kind, e in engines.items()},
        "native_decode": {kind: e.plan.attention.describe().get("native_decode") for kind, e in engines.items()},
        "contexts": {},
    }
    runs: dict[int, dict[str, list[dict[str, float]]]] = {n: {kind: [] for kind in KINDS} for n in contexts}
    for r in range(args.rounds):
        for n in contexts:
            tokens = document_tokens(reference, n, offset=1000 * (r + 1) + n)
            # The order alternates by round, so neither engine always runs second.
            for kind in KINDS if r % 2 == 0 else reversed(KINDS):
                runs[n][kind].append(engine_clocks(engines[kind], tokens, args.decode_tokens))
    for n in contexts:
        entry = {kind: summary(runs[n][kind]) for kind in KINDS}
        a, b = entry["activations"], entry["int8"]
        entry["int8_vs_activations"] = {"decode_best": b["decode_tokens_per_s_best"] / a["decode_tokens_per_s_best"],
                                 "decode_median": b["decode_tokens_per_s_median"] / a["decode_tokens_per_s_median"],
                                 "ttft_best": b["ttft_s_best"] / a["ttft_s_best"]}
        result["contexts"][str(n)] = entry
    short, long = str(min(contexts)), str(max(contexts))
    result["decode_long_vs_short_best"] = {
        kind: result["contexts"][long][kind]["decode_tokens_per_s_best"]
        / result["contexts"][short][kind]["decode_tokens_per_s_best"] for kind in KINDS}
    # Each round decodes both contexts within seconds of each other, so its ratio sees one state of the
    # shared machine; best over best can pair a quiet moment's short run with a busy one's long run.
    paired = {kind: [lr["decode_tokens_per_s"] / sr["decode_tokens_per_s"]
                     for sr, lr in zip(runs[min(contexts)][kind], runs[max(contexts)][kind], strict=True)]
              for kind in KINDS}
    result["decode_long_vs_short_per_round"] = paired
    result["decode_long_vs_short_median_of_rounds"] = {kind: statistics.median(r) for kind, r in paired.items()}
    result["load_average_1min_at_end"] = os.getloadavg()[0]
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
