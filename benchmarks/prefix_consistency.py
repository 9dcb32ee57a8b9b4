"""Does a prefix-cache hit give the answer the miss gives? Hit against miss on held-out prompts, per dispatch.

    .venv/bin/python -P benchmarks/prefix_consistency.py [--dispatch native,avx2] [--prompts 16] [--tokens 12]
        [--quantization auto] [--out FILE]

Each prompt is a stretch of this repository's own documentation (docs/*.md, README.md: text the model was
never tuned on) of h whole KV blocks, h spread over 1-64, then a question. Per prompt, one engine first
serves the stretch with another question (so its h blocks are cached), then the prompt itself: a hit of
h blocks. A second engine over the same weights, prefix caching off, serves the prompt: the miss. Both
decode --tokens greedily with the top-5 logprobs. Reported: the largest shift of a top-5 logprob between
hit and miss (over the positions where both have decoded the same tokens so far), the share of prompts
whose greedy text is identical, and whether the logprobs are equal bit for bit.

`--dispatch avx2` reruns this script in a child under ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
MKL_ENABLE_INSTRUCTIONS=AVX2 (a CPU without AVX-512: fp32 activations, int8 KV rows by default), so one
run covers both dispatches. JSON out (benchmarks/results/prefix_consistency*.json).
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

from decodeservice.engine import Engine, RequestOutput, SamplingParams
from decodeservice.engine.config import EngineConfig
from decodeservice.engine.quant import detect_cpu

ROOT = Path(__file__).resolve().parent.parent
HIT_BLOCKS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64)
QUESTIONS = ("What is this text about?", "Summarise the previous paragraph in one sentence.",
             "Which command does the text mention first?", "Name one number that appears above.",
             "Who would read this, and why?", "What should a new engineer check first?")


def corpus(engine: Engine) -> list[int]:
    text = "\n\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    return engine.tokenizer.encode(text, add_special_tokens=False)


def top5_shift(a: RequestOutput, b: RequestOutput) -> float:
    """Largest |logprob difference| over the tokens both top-5 lists hold, up to the first differing token."""
    shift = 0.0
    assert a.logprobs is not None and b.logprobs is not None
    for x, y in zip(a.logprobs, b.logprobs, strict=False):
        shift = max([shift, *(abs(lp - y.top[t]) for t, lp in x.top.items() if t in y.top)])
        if x.token_id != y.token_id:
            break
    return shift


def measure(*, prompts: int, tokens: int, quantization: str, block_size: int) -> dict[str, Any]:
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    loaded = Engine.from_pretrained("smollm2-135m", quantization=quantization, block_size=block_size)
    cached = loaded  # its pool and cache serve the hits
    fresh = Engine(model=loaded.model, tokenizer=loaded.tokenizer,
                   config=EngineConfig(quantization=quantization, block_size=block_size, enable_prefix_caching=False))
    ids = corpus(loaded)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, logprobs=5, ignore_eos=True)
    rows: list[dict[str, Any]] = []
    start = time.perf_counter()
    offset = 0
    for i in range(prompts):
        h = HIT_BLOCKS[i % len(HIT_BLOCKS)]
        stretch = ids[offset : offset + h * block_size]
        offset += h * block_size + 97  # the next prompt starts elsewhere: its blocks are not cached
        enc = loaded.tokenizer.encode
        question = enc(f"\n\nQuestion: {QUESTIONS[i % len(QUESTIONS)]}\nAnswer:", add_special_tokens=False)
        other = enc(f"\n\nQuestion: {QUESTIONS[(i + 1) % len(QUESTIONS)]} (warm-up)\nAnswer:", add_special_tokens=False)
        cached.generate([stretch + other], SamplingParams(max_tokens=1, temperature=0.0))
        hit = cached.generate([stretch + question], params)[0]
        miss = fresh.generate([stretch + question], params)[0]
        assert miss.metrics.num_cached_tokens == 0
        assert hit.logprobs is not None and miss.logprobs is not None
        rows.append({"hit_blocks": hit.metrics.num_cached_tokens // block_size, "prompt_tokens": len(stretch + question),
                     "top5_shift_nat": top5_shift(hit, miss), "same_text": hit.text == miss.text,
                     "bit_identical": [(x.token_id, x.top) for x in hit.logprobs] == [(x.token_id, x.top) for x in miss.logprobs]})
        print(json.dumps(rows[-1]), flush=True)
    return {
        "cpu": detect_cpu().describe(),
        "caps": caps_in_effect(),
        "activations": str(loaded.dtype).removeprefix("torch."),
        "kv_cache": str(loaded.kv_dtype).removeprefix("torch."),
        "weights": loaded.model.weight_format,
        "threads": torch.get_num_threads(),
        "prompts": len(rows),
        "max_top5_shift_nat": max(r["top5_shift_nat"] for r in rows),
        "same_text_share": sum(r["same_text"] for r in rows) / len(rows),
        "bit_identical_share": sum(r["bit_identical"] for r in rows) / len(rows),
        "seconds": round(time.perf_counter() - start, 1),
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dispatch", default="native,avx2", help="native, avx2 or both (comma-separated)")
    parser.add_argument("--prompts", type=int, default=len(HIT_BLOCKS))
    parser.add_argument("--tokens", type=int, default=12)
    parser.add_argument("--quantization", default="auto", choices=("auto", "none", "int8", "int4"))
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/prefix_consistency.json")
    args = parser.parse_args()
    run = {"prompts": args.prompts, "tokens": args.tokens, "quantization": args.quantization,
           "block_size": args.block_size}
    run_study(__file__, dispatches=args.dispatch, child=args.child, run=run, measure=measure, out=args.out,
              shown=("activations", "kv_cache", "weights", "max_top5_shift_nat", "same_text_share",
                     "bit_identical_share", "seconds"))


if __name__ == "__main__":
    main()
