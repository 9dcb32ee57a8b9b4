"""What a prompt-row weight route does to the output: each route's first-token top-5 logprobs and greedy text
against a baseline route's, on the same prompts, one engine per route. JSON out.

    .venv/bin/python -P benchmarks/prompt_route_quality.py [--routes packed,none,plan] [--prompts 8]
        [--tokens 16] [--threads 2] [--out FILE]

Routes as benchmarks/prefill_breakdown.py sets them (the first the baseline): `packed` the bf16 packed
dense copy, `none` the weight-only kernel (the int8-dot kernel: int8 activations per group of 32, what
every decode row runs), `plan` what the engine's kernel plan chose, `ROUTE@REV` with the int8-dot kernel
at git revision REV. Prompts: stretches of the repo's docs, 150-465 tokens, each with a question, no
prefix hit (each engine sees each prompt once). Reported per route: the first token's largest top-5
logprob shift against the baseline , the same over
the greedy continuation up to its first differing token, and the share of prompts with the same text;
and the first token's shift between every other pair of routes (`A~B`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))  # `python -P` leaves the script's folder off the path
from json_out import emit
from prefill_breakdown import set_prompt_route
from prefix_consistency import QUESTIONS, corpus, top5_shift

from decodeservice.engine import Engine, RequestOutput, SamplingParams
from decodeservice.engine.quant import detect_cpu

LENGTHS = (150, 210, 270, 330, 390, 430, 465, 180)  # prompt tokens before the question


def first_token_shift(a: RequestOutput, b: RequestOutput) -> float:
    """Largest |logprob difference| over the tokens both first-token top-5 lists hold."""
    assert a.logprobs is not None and b.logprobs is not None
    x, y = a.logprobs[0], b.logprobs[0]
    return max(abs(lp - y.top[t]) for t, lp in x.top.items() if t in y.top)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--routes", default="packed,none,plan")
    parser.add_argument("--prompts", type=int, default=len(LENGTHS))
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    routes = args.routes.split(",")
    engines = {route: Engine.from_pretrained("smollm2-135m", max_model_len=2048) for route in routes}
    for route, engine in engines.items():
        set_prompt_route(engine, route)
    first = engines[routes[0]]
    ids = corpus(first)
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, logprobs=5, ignore_eos=True)
    rows: list[dict[str, Any]] = []
    offset = 0
    for i in range(args.prompts):
        length = LENGTHS[i % len(LENGTHS)]
        question = first.tokenizer.encode(f"\n\nQuestion: {QUESTIONS[i % len(QUESTIONS)]}\nAnswer:",
                                          add_special_tokens=False)
        prompt = ids[offset:offset + length] + question
        offset += length + 97
        outputs = {route: engine.generate([prompt], params)[0] for route, engine in engines.items()}
        base = outputs[routes[0]]
        row: dict[str, Any] = {"prompt_tokens": len(prompt)}
        for route in routes[1:]:
            row[route] = {"first_token_top5_shift_nat": round(first_token_shift(outputs[route], base), 4),
                          "top5_shift_nat": round(top5_shift(outputs[route], base), 4),
                          "same_text": outputs[route].text == base.text}
        # every other pair too: two routes of the same numerics but for rounding show the measure's floor
        row["pairs_first_token_top5_shift_nat"] = {
            f"{a}~{b}": round(first_token_shift(outputs[a], outputs[b]), 4)
            for i, a in enumerate(routes[1:], 1) for b in routes[i + 1:]}
        rows.append(row)
        print(row, file=sys.stderr, flush=True)
    summary = {route: {"first_token_top5_shift_nat": [min(r[route]["first_token_top5_shift_nat"] for r in rows),
                                                      max(r[route]["first_token_top5_shift_nat"] for r in rows)],
                       "top5_shift_nat_max": max(r[route]["top5_shift_nat"] for r in rows),
                       "same_text_share": sum(r[route]["same_text"] for r in rows) / len(rows)} for route in routes[1:]}
    for pair in rows[0]["pairs_first_token_top5_shift_nat"]:
        shifts = [r["pairs_first_token_top5_shift_nat"][pair] for r in rows]
        summary[pair] = {"first_token_top5_shift_nat": [min(shifts), max(shifts)]}
    emit({"baseline": routes[0], "cpu": detect_cpu().describe(), "aten": torch.backends.cpu.get_cpu_capability(),
          "caps": {k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
                   if k in os.environ},
          "activations": str(first.dtype).removeprefix("torch."), "weights": first.model.weight_format,
          "plan_prompt_routes": ({key: p.prompt_route for key, p in first.model.kernel_plan.shapes.items()}
                                 if first.model.kernel_plan is not None else None),
          "threads": args.threads, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
          "summary": summary, "prompts": rows}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
