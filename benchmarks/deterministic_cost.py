"""What deterministic mode costs: decode speed at 1 and 4 streams and the TTFT of a ~500-token prompt,
deterministic against default, per dispatch, in one run.

    .venv/bin/python -P benchmarks/deterministic_cost.py [--dispatch native,avx2] [--quantization auto]
        [--rounds 3] [--tokens 48] [--prompt-tokens 500] [--out FILE]

Two engines over the same model file in one process, one built with EngineConfig(deterministic=True) (its
own kernel plan: the int8-dot kernel on every int4 projection it fits), one default; prefix caching off,
speculation off. Each round measures both, alternately, on the same prompts:
- decode tok/s of 1 stream: the tokens after the first over the time from the first to the last;
- decode tok/s of 4 streams together (aggregate), over the steps after all four have their first token;
- TTFT of a ~500-token prompt (one chunk at the default max_num_batched_tokens), from its arrival to its
  first token.
Reported per dispatch: the best of the rounds for each figure and mode, and deterministic / default ratios
(below 1 for tok/s, above 1 for TTFT: the cost), with the load average before and after.

`--dispatch avx2` reruns this script in a child under ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
MKL_ENABLE_INSTRUCTIONS=AVX2 (fp32 activations, int8 KV rows by default). JSON out
(benchmarks/results/deterministic_cost.json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))  # `python -P` leaves the script's folder off the path

from dispatches import caps_in_effect, run_study

from decodeservice.engine import Engine, SamplingParams
from decodeservice.engine.quant import detect_cpu

ROOT = Path(__file__).resolve().parent.parent
MODES = ("default", "deterministic")


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def corpus(engine: Engine) -> list[int]:
    text = "\n\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    return engine.tokenizer.encode(text, add_special_tokens=False)


def decode_tok_s(engine: Engine, prompts: list[list[int]], tokens: int) -> float:
    """Aggregate tok/s of `prompts` decoded together, over the steps after every one has its first token."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    ids = {engine.add_request(p, params) for p in prompts}
    started: set[str] = set()
    while started != ids:  # prefill (one chunk each) and each one's first token
        started |= {o.request_id for o in engine.step() if o.new_token_ids}
    count, start = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        count += sum(len(o.new_token_ids) for o in engine.step())
    return count / (time.perf_counter() - start)


def ttft_s(engine: Engine, prompt: list[int]) -> float:
    out = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))[0]
    assert out.metrics.first_token_time is not None and out.metrics.num_cached_tokens == 0
    return out.metrics.first_token_time - out.metrics.arrival_time


def measure(*, quantization: str, rounds: int, tokens: int, prompt_tokens: int) -> dict[str, Any]:
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    load_before = load_average()
    config = {"quantization": quantization, "enable_prefix_caching": False, "kv_cache_gib": 0.25}
    engines = {mode: Engine.from_pretrained("smollm2-135m", deterministic=mode == "deterministic", **config)
               for mode in MODES}
    ids = corpus(engines["default"])
    short = [ids[i * 40 : i * 40 + 32] for i in range(4)]
    samples: dict[str, dict[str, list[float]]] = {m: {"decode_1": [], "decode_4": [], "ttft": []} for m in MODES}
    for mode in MODES:  # warm-up: first calls pay for allocation and kernel selection
        decode_tok_s(engines[mode], short[:1], 4)
        ttft_s(engines[mode], ids[1000 : 1000 + prompt_tokens])
    start = time.perf_counter()
    for r in range(rounds):
        long_prompt = ids[2000 + r * prompt_tokens : 2000 + (r + 1) * prompt_tokens]  # a new one each round
        order = MODES if r % 2 == 0 else MODES[::-1]
        for mode in order:
            engine = engines[mode]
            samples[mode]["decode_1"].append(decode_tok_s(engine, short[:1], tokens))
            samples[mode]["decode_4"].append(decode_tok_s(engine, short, tokens))
            samples[mode]["ttft"].append(ttft_s(engine, long_prompt))
        print(json.dumps({"round": r, **{m: {k: round(v[-1], 3) for k, v in s.items()} for m, s in samples.items()}}),
              flush=True)
    best = {m: {"decode_1_tok_s": max(s["decode_1"]), "decode_4_tok_s": max(s["decode_4"]),
                "ttft_s": min(s["ttft"])} for m, s in samples.items()}
    det, base = best["deterministic"], best["default"]
    plan = engines["deterministic"].model.kernel_plan
    return {
        "cpu": detect_cpu().describe(),
        "caps": caps_in_effect(),
        "activations": str(engines["default"].dtype).removeprefix("torch."),
        "kv_cache": str(engines["default"].kv_dtype).removeprefix("torch."),
        "weights": engines["default"].model.weight_format,
        "deterministic_projections": None if plan is None else plan.describe()["rows"],
        "threads": torch.get_num_threads(),
        "rounds": rounds, "decode_tokens": tokens, "prompt_tokens": prompt_tokens,
        "best": {m: {k: round(v, 4) for k, v in b.items()} for m, b in best.items()},
        "ratio_deterministic_over_default": {
            "decode_1_tok_s": round(det["decode_1_tok_s"] / base["decode_1_tok_s"], 3),
            "decode_4_tok_s": round(det["decode_4_tok_s"] / base["decode_4_tok_s"], 3),
            "ttft_s": round(det["ttft_s"] / base["ttft_s"], 3),
        },
        "samples": samples,
        "load_average_before": load_before, "load_average_after": load_average(),
        "seconds": round(time.perf_counter() - start, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dispatch", default="native,avx2", help="native, avx2 or both (comma-separated)")
    parser.add_argument("--quantization", default="auto", choices=("auto", "none", "int8", "int4"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--prompt-tokens", type=int, default=500)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/deterministic_cost.json")
    args = parser.parse_args()
    run = {"quantization": args.quantization, "rounds": args.rounds, "tokens": args.tokens,
           "prompt_tokens": args.prompt_tokens}
    run_study(__file__, dispatches=args.dispatch, child=args.child, run=run, measure=measure, out=args.out,
              shown=("activations", "kv_cache", "weights", "best", "ratio_deterministic_over_default"))


if __name__ == "__main__":
    main()
