"""Is the default engine's text after long prompts as good as fp32's? JSON out.

    .venv/bin/python -P benchmarks/long_prompt_quality.py [--prompt-tokens 200,700,1800] [--kv-cache-dtype auto]
        [--out FILE]
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 .venv/bin/python -P benchmarks/long_prompt_quality.py

For each prompt length: the bundled model's default engine (quantization and dtype auto: int4 with the
activations this CPU's kernel plan picks) and the same file dequantized to fp32 each continue a
summarization prompt with `--decode-tokens` greedy tokens; the fp32 model scores both continuations
(mean negative log-likelihood per token). The target: the default within 1 nat/token of
fp32's own. The second command runs the same on ATen's AVX2 dispatch and oneDNN without native bf16,
which is how an AVX-512 machine checks the paths of one without it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))  # `python -P` leaves the script's folder off the path

from engine_vs_peers import ARTICLE


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt-tokens", default="200,700,1800")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"],
                        help="the default engine's KV pool (int8: kv_int8.py's rows); fp32's stays fp32")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from decodeservice.engine import Engine, SamplingParams

    default = Engine.from_pretrained("smollm2-135m", kv_cache_gib=0.3, max_model_len=2048, enable_prefix_caching=False,
                                     kv_cache_dtype=args.kv_cache_dtype)
    fp32 = Engine.from_pretrained("smollm2-135m", quantization="none", dtype="float32", kv_cache_gib=0.3,
                                  max_model_len=2048, enable_prefix_caching=False)
    tok = default.tokenizer
    greedy = SamplingParams(max_tokens=args.decode_tokens, temperature=0.0, ignore_eos=True)
    rows: list[dict[str, Any]] = []
    for target in (int(t) for t in args.prompt_tokens.split(",")):
        article = ARTICLE * max(1, round(target / len(tok.encode(ARTICLE))))
        prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": article + "\nSummarize the text above."}]))
        row: dict[str, Any] = {"prompt_tokens": len(prompt)}
        for name, engine in (("default", default), ("fp32", fp32)):
            start = time.perf_counter()
            out = engine.generate([prompt], greedy)[0]
            ids = torch.tensor(prompt + out.token_ids)
            logits = fp32.model.forward_dense(ids)[len(prompt) - 1 : -1].float()
            nll = -float(logits.log_softmax(-1).gather(1, torch.tensor(out.token_ids)[:, None]).mean())
            row[name] = {"nll_per_token": round(nll, 4), "seconds": round(time.perf_counter() - start, 2),
                         "text": out.text}
        row["nll_gap"] = round(row["default"]["nll_per_token"] - row["fp32"]["nll_per_token"], 4)
        row["within_1_nat"] = row["nll_gap"] <= 1.0
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("default", "fp32")}), file=sys.stderr)
    plan = default.model.kernel_plan
    result = {"kernels": plan.describe() if plan else None, "kv_cache_dtype": str(default.kv_dtype).removeprefix("torch."),
              "torch": torch.__version__, "threads": args.threads,
              "date": time.strftime("%Y-%m-%d"), "rows": rows}
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
