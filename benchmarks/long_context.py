"""Long context: the engine and llama.cpp side by side in one run, prefix hit vs miss. JSON out.

    .venv/bin/python -P benchmarks/long_context.py [--threads 1] [--contexts 512,1024,2048,4096]
        [--decode-tokens 32] [--quantization auto] [--dtype auto] [--kv-cache-dtype auto]
        [--out FILE]

For each context N: a document of N tokens, then a question of about 10 tokens.
- miss: TTFT of document + question A with nothing of it cached, and decode tokens/s of the answer
  after its first token; prefill throughput = prompt tokens / miss TTFT;
- hit: TTFT of the same document + question B, the document now in the prefix cache (llama.cpp
  reuses its context's common prefix the same way);
- the engine's decode tokens/s again over the same context with the gather backend, and with the CPU
  backend without its native paged kernel (native_decode.py: its plain path alone), so the two meet in
  one run.
The reference for the decode target is the same engine decoding after an 8-token prompt (best of
two); decode ratios take the best of the default backend's three measurements at a context (miss,
hit, hit again) and of llama.cpp's two (miss, hit), which run right after the engine's at that context. Then one
layer's attention call at the bundled model's shapes for every mechanism tried (decode over L keys,
a 512-token chunk over L cached keys; best of --repeats, microseconds); with --flex, torch
flex_attention compiled for CPU too (its compile takes minutes). llama.cpp (optional extra `bench`) runs the GGUF as it is stored
(Q4_1); the engine runs at --quantization/--dtype, by default the engine's own default (int4 weights
from the same Q4_1 codes, bf16 activations and KV cache on CPU; `--quantization none` is fp32).
Every figure is one run on a shared machine.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from decodeservice.engine import Engine, SamplingParams
from decodeservice.engine.attention import (
    AttentionBackend,
    AttentionMetadata,
    SequenceSpan,
    StepAttention,
    attend,
    native_decode,
    slot_runs,
)
from decodeservice.engine.attention.gather import GatherBackend
from decodeservice.engine.attention.paged_views import PagedViewsBackend

sys.path.insert(0, str(Path(__file__).parent))  # `python -P` leaves the script's folder off the path
from json_out import emit

DOCUMENT = (
    "Chapter {i}. The survey team walked the northern ridge at dawn, logging every spring, path and ruined wall "
    "they passed. Their notes describe the weather, the soil, the birds they heard and the distance covered. "
)
QUESTIONS = ("Question: what did the team log on the ridge?", "Question: how far did the team walk that day?")


def document_tokens(engine: Engine, n: int, offset: int) -> list[int]:
    """n tokens of running text; `offset` makes documents of different lengths differ from token 0."""
    text, i = "", offset
    while len(ids := engine.tokenizer.encode(text, add_special_tokens=False)) < n:
        text += DOCUMENT.format(i=i)
        i += 1
    return ids[:n]


def engine_clocks(engine: Engine, tokens: list[int], new_tokens: int) -> dict[str, float]:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(tokens, params)
    first, cached = None, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if first is None and out.new_token_ids:
                first = time.perf_counter()
                cached = out.metrics.num_cached_tokens
    end = time.perf_counter()
    assert first is not None
    return {"ttft_s": first - start, "decode_tokens_per_s": (new_tokens - 1) / (end - first),
            "cached_tokens": cached}


def llama_clocks(llm: Any, tokens: list[int], new_tokens: int, *, reset: bool) -> dict[str, float]:
    if reset:
        llm.reset()  # forget the context, so nothing is reused: a miss
    start = time.perf_counter()
    first, count = None, 0
    for _ in llm.create_completion(tokens, max_tokens=new_tokens, temperature=0.0, stream=True,
                                   logit_bias={llm.token_eos(): -1e9}):
        count += 1
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    assert first is not None and count > 1
    return {"ttft_s": first - start, "decode_tokens_per_s": (count - 1) / (end - first)}


def best_us(fn: Any, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e6


def attention_options(contexts: list[int], repeats: int, dtype: torch.dtype) -> dict[str, Any]:
    """One layer's attention at SmolLM2-135M's shapes (9 query heads, 3 K/V heads, D 64) in the
    engine's activation dtype. One pool, so its keys are warm in cache (the engine's are not)."""
    h, hkv, d, bs = 9, 3, 64, 16
    gen = torch.Generator().manual_seed(0)
    pool_blocks = (max(contexts) + 512) // bs * 2
    k_cache = torch.randn(pool_blocks, bs, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(pool_blocks, bs, hkv, d, generator=gen).to(dtype)
    backends: list[tuple[str, AttentionBackend]] = [
        ("views", PagedViewsBackend()), ("gather", GatherBackend())]
    if (kernel := native_decode.decode_extension()) is not None and native_decode.applies(dtype, d):
        backends.append(("native", PagedViewsBackend(kernel=kernel)))
    scattered = torch.randperm(pool_blocks, generator=gen).tolist()
    results: dict[str, Any] = {}
    for length in contexts:
        row: dict[str, float] = {}
        for q_len, label in ((1, "decode"), (512, "chunk512")):
            total = length + (q_len if q_len > 1 else 0)
            n_blocks = -(-total // bs)
            q = torch.randn(q_len, h, d, generator=gen).to(dtype)
            k = torch.randn(q_len, hkv, d, generator=gen).to(dtype)
            v = torch.randn(q_len, hkv, d, generator=gen).to(dtype)
            for layout, blocks in (("contiguous", list(range(n_blocks))), ("scattered", scattered[:n_blocks])):
                span = SequenceSpan(token_start=0, num_new=q_len, context_len=total,
                                    runs=slot_runs(blocks, num_tokens=total, block_size=bs),
                                    block_table=torch.tensor(blocks))
                slots = torch.tensor([blocks[p // bs] * bs + p % bs for p in range(total - q_len, total)])
                meta = AttentionMetadata(slot_mapping=slots, spans=(span,), block_size=bs)
                for name, backend in backends:
                    if name not in ("views", "native") and layout == "scattered":
                        continue  # a copy does not care where the blocks lie
                    if name == "native" and q_len > 1:
                        continue  # it takes one-token decodes only
                    # planned as in a step: the native kernel's block table is built by plan()
                    step = StepAttention(meta=backend.plan(meta, dtype=dtype) if name == "native" else meta,
                                         backend=backend)
                    args = (q, k, v, k_cache, v_cache, step)
                    row[f"{label}_{name}_{layout}_us"] = best_us(lambda args=args: attend(*args), repeats)
            if q_len == 1:
                row["decode_runs_when_scattered"] = len(span.runs)
        results[str(length)] = row
    return results


def flex_probe(length: int, repeats: int) -> dict[str, Any]:
    """torch flex_attention compiled for CPU over a block-table mask: compile time and a decode call."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        h, hkv, d = 9, 3, 64
        q, k, v = torch.randn(1, h, 1, d), torch.randn(1, hkv, length, d), torch.randn(1, hkv, length, d)
        mask = create_block_mask(lambda b, hh, qi, ki: ki < length, 1, None, 1, length, device="cpu")
        start = time.perf_counter()
        compiled = torch.compile(flex_attention, dynamic=False)
        compiled(q, k, v, block_mask=mask, enable_gqa=True)
        compile_s = time.perf_counter() - start
        call = best_us(lambda: compiled(q, k, v, block_mask=mask, enable_gqa=True), repeats)
        return {"context": length, "compile_and_first_call_s": compile_s, "decode_us": call}
    except Exception as exc:  # any failure to compile is itself the finding
        return {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--contexts", default="512,1024,2048,4096")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5, help="attention micro-benchmark repeats")
    parser.add_argument("--quantization", default=None, choices=["auto", "none", "int8", "int4"],
                        help="the engine's weights (default: the engine's default, auto)")
    parser.add_argument("--dtype", default=None, choices=["auto", "float32", "float16", "bfloat16"])
    parser.add_argument("--kv-cache-dtype", default=None, choices=["auto", "int8"],
                        help="the engine's KV pool (default: the engine's default, auto)")
    parser.add_argument("--skip-llama", action="store_true")
    parser.add_argument("--flex", action="store_true",
                        help="also compile torch flex_attention for CPU (minutes of inductor compile)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    contexts = [int(c) for c in args.contexts.split(",")]

    precision = {k: v for k, v in (("quantization", args.quantization), ("dtype", args.dtype),
                                   ("kv_cache_dtype", args.kv_cache_dtype)) if v is not None}
    engine = Engine.from_pretrained("smollm2-135m", max_model_len=max(contexts) + 2 * args.decode_tokens + 64,
                                    **precision)
    questions = [engine.tokenizer.encode(q, add_special_tokens=False) for q in QUESTIONS]
    documents = {n: document_tokens(engine, n, offset=i * 1000) for i, n in enumerate(contexts)}
    engine_clocks(engine, questions[0], 4)  # warm-up
    result: dict[str, Any] = {
        "threads": args.threads, "engine_dtype": str(engine.dtype).removeprefix("torch."),
        "engine_weights": engine.model.weight_format, "kv_cache_dtype": str(engine.kv_dtype).removeprefix("torch."),
        "decode_tokens": args.decode_tokens,
        "note": "one run on a machine shared with other jobs; the engine's attention backend: "
                + engine.runner.attention_backend.name,
        "load_average_1min_at_start": os.getloadavg()[0],  # above the thread count: figures are contended
        "engine_short_context_decode_tokens_per_s": max(
            engine_clocks(engine, questions[0][:8], args.decode_tokens)["decode_tokens_per_s"] for _ in range(2)),
        "contexts": {},
    }
    llm = load_llama(args, contexts, questions)
    if isinstance(llm, str):
        result["llama_cpp"] = llm
    else:
        result["llama_cpp"] = {"weights": "Q4_1 (the GGUF as stored)", "short_context_decode_tokens_per_s": max(
            llama_clocks(llm, questions[0][:8], args.decode_tokens, reset=True)["decode_tokens_per_s"]
            for _ in range(2))}
    gather, views = GatherBackend(), engine.runner.attention_backend
    # The engine's backend without the native paged kernel (its plain path alone): that kernel's A/B.
    torch_paths = PagedViewsBackend(kv_int8=getattr(views, "kv_int8", False))
    # Engine and llama.cpp take turns per context, so a change in the machine's load between them
    # weighs on both; decode ratios use the best of each side's measurements at that context
    # (interference only ever slows a measurement down).
    for n in contexts:
        doc = documents[n]
        entry: dict[str, Any] = {"question_tokens": [len(q) for q in questions]}
        miss = engine_clocks(engine, doc + questions[0], args.decode_tokens)
        hit = engine_clocks(engine, doc + questions[1], args.decode_tokens)
        engine.runner.attention_backend = gather
        copied = engine_clocks(engine, doc + questions[1], args.decode_tokens)
        engine.runner.attention_backend = torch_paths
        torch_only = engine_clocks(engine, doc + questions[1], args.decode_tokens)
        engine.runner.attention_backend = views
        again = engine_clocks(engine, doc + questions[1], args.decode_tokens)
        best = max(m["decode_tokens_per_s"] for m in (miss, hit, again))
        entry["engine"] = {
            "miss": miss, "hit": hit, "hit_speedup": miss["ttft_s"] / hit["ttft_s"],
            "prefill_tokens_per_s": (n + len(questions[0])) / miss["ttft_s"],
            "decode_tokens_per_s_gather_backend": copied["decode_tokens_per_s"],
            # The same hit request without the native kernel, then again on the default backend (the
            # third measurement of the default at this context).
            "decode_tokens_per_s_without_native_kernel": torch_only["decode_tokens_per_s"],
            "decode_tokens_per_s_views_again": again["decode_tokens_per_s"],
            "decode_tokens_per_s_best": best,
            "decode_vs_short_context": best / result["engine_short_context_decode_tokens_per_s"],
        }
        if not isinstance(llm, str):
            l_miss = llama_clocks(llm, doc + questions[0], args.decode_tokens, reset=True)
            l_hit = llama_clocks(llm, doc + questions[1], args.decode_tokens, reset=False)
            entry["llama_cpp"] = {"miss": l_miss, "hit": l_hit, "hit_speedup": l_miss["ttft_s"] / l_hit["ttft_s"],
                                  "prefill_tokens_per_s": (n + len(questions[0])) / l_miss["ttft_s"]}
            entry["engine_decode_vs_llama_cpp"] = best / max(l_miss["decode_tokens_per_s"], l_hit["decode_tokens_per_s"])
            entry["engine_decode_vs_llama_cpp_miss_vs_miss"] = (miss["decode_tokens_per_s"]
                                                                / l_miss["decode_tokens_per_s"])
        result["contexts"][str(n)] = entry

    result["attention_per_layer_call"] = attention_options(contexts, args.repeats, engine.dtype)
    if args.flex:
        result["attention_per_layer_call"]["flex_attention"] = flex_probe(max(contexts), args.repeats)
    result["load_average_1min_at_end"] = os.getloadavg()[0]
    result["targets"] = targets(result, contexts)
    emit(result, args.out)
    return 0


def load_llama(args: argparse.Namespace, contexts: list[int], questions: list[list[int]]) -> Any:
    """llama.cpp on the bundled GGUF, warmed up, or why not (a string)."""
    if args.skip_llama:
        return "skipped (--skip-llama)"
    try:
        from llama_cpp import Llama
    except ImportError:
        return "skipped: llama-cpp-python is not installed (pip install '.[peers]')"
    from decodeservice.engine.loader import ensure_model

    llm = Llama(model_path=str(ensure_model("smollm2-135m", progress=False)), n_threads=args.threads,
                n_threads_batch=args.threads, n_ctx=max(contexts) + 2 * args.decode_tokens + 64,
                n_batch=512, verbose=False)
    llama_clocks(llm, questions[0], 4, reset=True)  # warm-up
    return llm


def targets(result: dict[str, Any], contexts: list[int]) -> dict[str, Any]:
    engine = {n: result["contexts"][str(n)]["engine"] for n in contexts}
    prefill = [engine[n]["prefill_tokens_per_s"] for n in contexts]
    longest = engine[max(contexts)]
    out: dict[str, Any] = {
        "hit_ttft_10x_below_miss_from_1k": {
            "speedups": {n: engine[n]["hit_speedup"] for n in contexts if n >= 1024},
            "met": bool([n for n in contexts if n >= 1024])
            and all(engine[n]["hit_speedup"] >= 10 for n in contexts if n >= 1024)},
        "decode_at_longest_vs_short_0.85x": {"ratio": longest["decode_vs_short_context"],
                                             "met": longest["decode_vs_short_context"] >= 0.85},
        "prefill_throughput_within_15pct": {"min_over_max": min(prefill) / max(prefill),
                                            "met": min(prefill) / max(prefill) >= 0.85},
    }
    llama_entry = result["contexts"][str(max(contexts))].get("llama_cpp")
    if llama_entry is not None:
        ratio = result["contexts"][str(max(contexts))]["engine_decode_vs_llama_cpp"]
        out["decode_at_longest_vs_llama_cpp"] = {
            "ratio": ratio, "met": ratio >= 1.0,
            "note": f"engine {result['engine_weights']} weights, {result['engine_dtype']} activations, "
                    f"{result['kv_cache_dtype']} KV vs llama.cpp Q4_1 (f16 KV)"}
    return out


if __name__ == "__main__":
    sys.exit(main())
