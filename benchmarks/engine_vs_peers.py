"""Engine vs HF transformers on the bundled model, fp32, side by side in one run. JSON to stdout.

    .venv/bin/python benchmarks/engine_vs_peers.py [--threads 2] [--decode-tokens 128] [--out FILE]

Two clocks, measured separately, on a ~600-token summarization prompt and a short chat prompt:
- TTFT: the prefill of the prompt plus the first token (prefix caching off, so it is real work);
- decode tokens/s: new greedy tokens after the first, divided by the time after the first token.
Then the engine's aggregate decode tokens/s with 1, 8 and 32 concurrent sequences, its peak RSS
(taken before the HF model is loaded into the same process), and the fp32 weight-streaming ceiling
(one matrix-vector product per weight matrix) measured in the same run. Medians over `--repeats` runs.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from decodeservice.engine import Engine, SamplingParams

ARTICLE = (
    "The city council met on Tuesday to discuss the new public transport plan. The plan adds three bus "
    "lines, extends the tram to the northern districts, and replaces the oldest diesel buses with electric "
    "ones over the next five years. Supporters said the changes would cut commuting times and air "
    "pollution, while critics worried about the cost, estimated at 240 million euros, and about "
    "construction noise in residential streets. The mayor promised a public consultation in the spring "
    "and said that ticket prices would not rise before 2027. "
)


def summarize_prompt(engine: Engine, target_tokens: int = 600) -> str:
    body = ""
    while True:
        candidate = body + ARTICLE
        text = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Summarize the following report in three sentences.\n\n{candidate}"}])
        if len(engine.tokenizer.encode(text)) > target_tokens:
            return text if body else candidate
        body = candidate


def engine_two_clocks(engine: Engine, prompt: str, new_tokens: int) -> tuple[float, float]:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(prompt, params)
    first = None
    while engine.has_unfinished_requests():
        outs = engine.step()
        if first is None and outs and outs[0].new_token_ids:
            first = time.perf_counter()
    end = time.perf_counter()
    assert first is not None
    return first - start, (new_tokens - 1) / (end - first)


def hf_two_clocks(model: Any, ids: torch.Tensor, new_tokens: int) -> tuple[float, float]:
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        start = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False, pad_token_id=0)
        ttft = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False, pad_token_id=0)
        total = time.perf_counter() - start
    return ttft, (new_tokens - 1) / (total - ttft)


def engine_batched(engine: Engine, prompt: str, concurrency: int, new_tokens: int) -> float:
    """Aggregate decode tokens/s once every sequence has its first token."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for i in range(concurrency):
        engine.add_request(f"{i}: {prompt}", params)
    produced = 0
    started: float | None = None
    active = set()
    while engine.has_unfinished_requests():
        outs = engine.step()
        if started is None:
            active.update(o.request_id for o in outs if o.new_token_ids)
            if len(active) == concurrency:
                started = time.perf_counter()
            continue
        produced += sum(len(o.new_token_ids) for o in outs)
    assert started is not None
    return produced / (time.perf_counter() - started)


def weight_streaming_cap(engine: Engine, repeats: int = 10) -> float:
    """Tokens/s if a decode step did nothing but one matrix-vector product per weight matrix: the
    memory-bandwidth ceiling for single-stream fp32 decode on this machine, measured, not assumed."""
    # The engine's own projections (oneDNN-packed on CPU), one row each: the same kernels decode uses.
    layers = [m for m in engine.model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = {m.in_features: torch.randn(1, m.in_features) for m in layers}
    with torch.inference_mode():
        for m in layers:
            m(inputs[m.in_features])
        start = time.perf_counter()
        for _ in range(repeats):
            for m in layers:
                m(inputs[m.in_features])
    return repeats / (time.perf_counter() - start)


def median(values: list[float]) -> float:
    return statistics.median(values)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    engine = Engine.from_pretrained("smollm2-135m", enable_prefix_caching=False, max_num_seqs=64)
    prompts = {
        "summarize": summarize_prompt(engine),
        "chat": engine.tokenizer.apply_chat_template([{"role": "user", "content": "Tell me about the moon."}]),
    }
    engine_two_clocks(engine, prompts["chat"], 8)  # warm-up
    result: dict[str, Any] = {"threads": args.threads, "dtype": "float32", "decode_tokens": args.decode_tokens,
                              "prompts": {}, "batched_decode_tokens_per_s": {}}
    for name, prompt in prompts.items():
        runs = [engine_two_clocks(engine, prompt, args.decode_tokens) for _ in range(args.repeats)]
        result["prompts"][name] = {
            "prompt_tokens": len(engine.tokenizer.encode(prompt)),
            "engine": {"ttft_s": median([r[0] for r in runs]), "decode_tokens_per_s": median([r[1] for r in runs])},
        }
    for concurrency in [int(c) for c in args.concurrency.split(",")]:
        result["batched_decode_tokens_per_s"][str(concurrency)] = engine_batched(
            engine, prompts["chat"], concurrency, args.decode_tokens)
    result["fp32_weight_streaming_cap_tokens_per_s"] = weight_streaming_cap(engine)
    result["engine_peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    single = result["batched_decode_tokens_per_s"].get("1")
    top = result["batched_decode_tokens_per_s"].get("32")
    if single and top:
        result["batched_32_vs_1"] = top / single

    if not args.skip_hf:
        import transformers

        from decodeservice.engine.loader import ensure_model

        path = ensure_model("smollm2-135m", progress=False)
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
        for name, prompt in prompts.items():
            ids = torch.tensor([engine.tokenizer.encode(prompt)])
            hf_two_clocks(hf, ids, 4)  # warm-up
            runs = [hf_two_clocks(hf, ids, args.decode_tokens) for _ in range(args.repeats)]
            entry = result["prompts"][name]
            entry["hf_transformers"] = {"ttft_s": median([r[0] for r in runs]),
                                        "decode_tokens_per_s": median([r[1] for r in runs])}
            entry["ttft_ratio_engine_over_hf"] = entry["engine"]["ttft_s"] / entry["hf_transformers"]["ttft_s"]
            entry["decode_speedup_vs_hf"] = (entry["engine"]["decode_tokens_per_s"]
                                             / entry["hf_transformers"]["decode_tokens_per_s"])
            entry["engine_decode_share_of_cap"] = (entry["engine"]["decode_tokens_per_s"]
                                                   / result["fp32_weight_streaming_cap_tokens_per_s"])
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
