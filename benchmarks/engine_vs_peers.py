"""The engine at fp32, bf16, int8 and int4 (speculation off and on) vs HF transformers and llama.cpp,
on the bundled model, in one run. JSON out.

    .venv/bin/python -P benchmarks/engine_vs_peers.py [--threads 2] [--decode-tokens 64] [--out FILE]

Every variant runs in its own process, one after the other, on the same prompts, so each peak RSS is
that variant's alone. Per variant:
- TTFT on a ~550-token summarization prompt (prefix caching off: the prefill is real work);
- single-stream decode tokens/s after the first token, on the summarization prompt (input-grounded:
  n-gram speculation can copy from it) and on a short open-ended chat prompt;
- for the engine without speculation, the aggregate decode tokens/s of 32 concurrent chat streams;
- for the default precision (int4), the torch.profiler breakdown of one decode step at 1 stream and at
  32, at 1 and 2 threads (benchmarks/decode_step.py, which also times each projection against rows).
llama.cpp runs through llama-cpp-python (the optional `bench` extra), skipped with a note when it is
not importable; its 32-stream aggregate is llama.cpp's own batching of the 32 sequences in one context,
as llama-server -np 32 runs it (benchmarks/llama_cpp_batched.py, through the C API).
The summary quotes every CPU target of the engine as a ratio measured in this one run. Medians over repeats.
`--rounds N` runs the variant list N times in turn and reports medians over rounds, with each ratio's
value per round (`ratios_by_round`): single runs move by 15-25% here with the machine's load.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))  # `python -P` leaves the script's folder off the path
from json_out import emit

ARTICLE = (
    "The city council met on Tuesday to discuss the new public transport plan. The plan adds three bus "
    "lines, extends the tram to the northern districts, and replaces the oldest diesel buses with electric "
    "ones over the next five years. Supporters said the changes would cut commuting times and air "
    "pollution, while critics worried about the cost, estimated at 240 million euros, and about "
    "construction noise in residential streets. The mayor promised a public consultation in the spring "
    "and said that ticket prices would not rise before 2027. "
)
PRECISIONS = {"fp32": ("none", "float32"), "bf16": ("none", "bfloat16"), "int8": ("int8", "auto"),
              "int4": ("int4", "auto")}
# Suffixes, combinable in this order: _w8a8, EngineConfig(w8a8=True), the opt-in: batches of 6+ rows run
# int8 activations x int8 weights; int4 keeps an int8 copy of its 4-bit weights for it (its peak RSS against
# engine_int4's is what the copy costs), int8 uses its own codes. _compiled, EngineConfig(compile=True):
# decode steps of up to 64 rows as one torch.compile graph (engine/compiled_step.py). _spec: n-gram drafts.
ENGINE_VARIANTS = [f"engine_{p}{s}" for p in PRECISIONS for s in ("", "_spec")] + [
    "engine_int4_compiled", "engine_int8_compiled", "engine_int4_w8a8", "engine_int8_w8a8",
    "engine_int4_w8a8_compiled", "engine_int8_w8a8_compiled"]
SUFFIXES = ("w8a8", "compiled", "spec")
PEERS = ["hf_transformers", "llama_cpp"]


def build_prompts(target_tokens: int) -> dict[str, str]:
    from decodeservice.engine.loader import ensure_model
    from decodeservice.engine.loader.gguf_loader import read_gguf_tokenizer

    tok = read_gguf_tokenizer(ensure_model("smollm2-135m", progress=False))
    body = ARTICLE
    while True:
        text = tok.apply_chat_template(
            [{"role": "user", "content": f"Summarize the following report in three sentences.\n\n{body}"}])
        if len(tok.encode(text)) >= target_tokens:
            break
        body += ARTICLE
    chat = tok.apply_chat_template([{"role": "user", "content": "Tell me about the moon."}])
    return {"summarize": text, "chat": chat}


# -- the engine -------------------------------------------------------------------------------------


def engine_variant(name: str, prompts: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from decodeservice.engine import Engine, SamplingParams

    precision, *suffixes = name.removeprefix("engine_").split("_")
    if precision not in PRECISIONS or not set(suffixes) <= set(SUFFIXES):
        raise SystemExit(f"unknown variant {name!r}: engine_<{'|'.join(PRECISIONS)}>[_w8a8][_compiled][_spec]")
    quantization, dtype = PRECISIONS[precision]
    spec = {"method": "ngram", "num_tokens": 8} if "spec" in suffixes else None
    start = time.perf_counter()
    engine = Engine.from_pretrained("smollm2-135m", quantization=quantization, dtype=dtype, speculative=spec,
                                    enable_prefix_caching=False, max_num_seqs=64, max_model_len=2048,
                                    kv_cache_gib=args.kv_cache_gib, compile="compiled" in suffixes,
                                    w8a8="w8a8" in suffixes)
    result: dict[str, Any] = {"load_s": time.perf_counter() - start, "weights": engine.model.weight_format,
                              "activations": str(engine.dtype).removeprefix("torch."), "w8a8": engine.config.w8a8,
                              "torch_threads": torch.get_num_threads()}

    def two_clocks(prompt: str, new_tokens: int) -> tuple[float, float]:
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        engine.add_request(prompt, params)
        first = None
        while engine.has_unfinished_requests():
            outs = engine.step()
            if first is None and outs and outs[0].new_token_ids:
                first = time.perf_counter()
        assert first is not None
        return first - t0, (new_tokens - 1) / (time.perf_counter() - first)

    two_clocks(prompts["chat"], 8)  # warm-up
    ttft = [two_clocks(prompts["summarize"], 2)[0] for _ in range(args.repeats)]
    result["ttft_s"] = statistics.median(ttft)
    for key in ("summarize", "chat"):
        rates = [two_clocks(prompts[key], args.decode_tokens)[1] for _ in range(args.repeats)]
        result[f"decode_tokens_per_s_{key}"] = statistics.median(rates)
    if spec is None and args.streams > 1:
        result[f"aggregate_{args.streams}_streams_tokens_per_s"] = batched(engine, prompts["chat"], args)
    if name == f"engine_{args.profile}":
        from decode_step import profile

        # Peak RSS of serving, before the profiler's event buffers (tens of MB at 32 streams) add to it.
        result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

        threads = sorted({args.threads, *(int(t) for t in args.profile_threads.split(","))})
        result["decode_step_profile"] = profile(engine, prompts["chat"], threads=threads, streams=args.streams)
    return result


def batched(engine: Any, prompt: str, args: argparse.Namespace) -> float:
    """Aggregate decode tokens/s once every stream has its first token."""
    from decodeservice.engine import SamplingParams

    params = SamplingParams(max_tokens=args.decode_tokens, temperature=0.0, ignore_eos=True)
    for i in range(args.streams):
        engine.add_request(f"{i}: {prompt}", params)
    produced, started, active = 0, None, set()
    while engine.has_unfinished_requests():
        outs = engine.step()
        if started is None:
            active.update(o.request_id for o in outs if o.new_token_ids)
            if len(active) == args.streams:
                started = time.perf_counter()
            continue
        produced += sum(len(o.new_token_ids) for o in outs)
    assert started is not None
    return produced / (time.perf_counter() - started)


# -- peers ------------------------------------------------------------------------------------------


def hf_variant(prompts: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import transformers

    from decodeservice.engine.loader import ensure_model
    from decodeservice.engine.loader.gguf_loader import read_gguf_tokenizer

    path = ensure_model("smollm2-135m", progress=False)
    tok = read_gguf_tokenizer(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32).eval()

    def two_clocks(prompt: str, new_tokens: int) -> tuple[float, float]:
        ids = torch.tensor([tok.encode(prompt)])
        mask = torch.ones_like(ids)
        with torch.inference_mode():
            t0 = time.perf_counter()
            model.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False, pad_token_id=0)
            ttft = time.perf_counter() - t0
            t0 = time.perf_counter()
            model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                           do_sample=False, pad_token_id=0)
            total = time.perf_counter() - t0
        return ttft, (new_tokens - 1) / (total - ttft)

    two_clocks(prompts["chat"], 4)
    result: dict[str, Any] = {"weights": "fp32", "torch_threads": torch.get_num_threads()}
    result["ttft_s"] = statistics.median(two_clocks(prompts["summarize"], 2)[0] for _ in range(args.repeats))
    for key in ("summarize", "chat"):
        result[f"decode_tokens_per_s_{key}"] = statistics.median(
            two_clocks(prompts[key], args.decode_tokens)[1] for _ in range(args.repeats))
    return result


def llama_cpp_variant(prompts: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    try:
        import llama_cpp
    except ImportError as exc:
        return {"skipped": f"llama-cpp-python is not importable ({exc}); install the `bench` extra"}
    from decodeservice.engine.loader import ensure_model

    path = ensure_model("smollm2-135m", progress=False)
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=2048, n_threads=args.threads, n_threads_batch=args.threads,
                          n_batch=512, verbose=False)

    def two_clocks(prompt: str, new_tokens: int) -> tuple[float, float]:
        ids = llm.tokenize(prompt.encode(), add_bos=False, special=True)
        llm.reset()  # no KV reuse from the previous call: the prefill is real work, as for the engine
        t0 = time.perf_counter()
        first, count = 0.0, 0
        for _token in llm.generate(ids, top_k=1, temp=0.0, reset=True):
            count += 1
            if count == 1:
                first = time.perf_counter()
            if count == new_tokens:
                break
        return first - t0, (new_tokens - 1) / (time.perf_counter() - first)

    two_clocks(prompts["chat"], 8)
    result: dict[str, Any] = {"version": llama_cpp.__version__, "weights": "gguf Q4_1 (its own kernels)",
                              "threads": args.threads,
                              # which of its kernels this build has (AVX2 only, AVX-512...): set when built
                              "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
                              "streams_note": "aggregate: llama.cpp's own batching of N sequences in one "
                                              "context, as llama-server -np N does (llama_cpp_batched.py)"}
    result["ttft_s"] = statistics.median(two_clocks(prompts["summarize"], 2)[0] for _ in range(args.repeats))
    for key in ("summarize", "chat"):
        result[f"decode_tokens_per_s_{key}"] = statistics.median(
            two_clocks(prompts[key], args.decode_tokens)[1] for _ in range(args.repeats))
    if args.streams > 1:
        from llama_cpp_batched import aggregate_tokens_per_s

        # Single-stream serving's peak, before the batched run's second model and 32-sequence context.
        result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        batched_run = aggregate_tokens_per_s(path, [f"{i}: {prompts['chat']}" for i in range(args.streams)],
                                             decode_tokens=args.decode_tokens, threads=args.threads)
        result[f"aggregate_{args.streams}_streams_tokens_per_s"] = batched_run["aggregate_tokens_per_s"]
    return result


# -- driver -----------------------------------------------------------------------------------------


def run_child(args: argparse.Namespace) -> int:
    prompts = json.loads(Path(args.prompts).read_text())
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.variant == "hf_transformers":
        result = hf_variant(prompts, args)
    elif args.variant == "llama_cpp":
        result = llama_cpp_variant(prompts, args)
    else:
        result = engine_variant(args.variant, prompts, args)
    result.setdefault("peak_rss_mib", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    Path(args.child_out).write_text(json.dumps(result))
    return 0


def ratios(variants: dict[str, dict[str, Any]], streams: int) -> dict[str, Any]:
    """The engine's CPU targets, each as a ratio of two figures from this run (None where one is missing)."""
    def get(name: str, key: str) -> float | None:
        value = variants.get(name, {}).get(key)
        return float(value) if isinstance(value, int | float) else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a is not None and b else None

    chat = "decode_tokens_per_s_chat"
    agg = f"aggregate_{streams}_streams_tokens_per_s"
    out: dict[str, Any] = {
        "int4_decode_vs_llama_cpp (target >= 1.0, stretch 1.3)": ratio(get("engine_int4", chat), get("llama_cpp", chat)),
        "int8_decode_vs_llama_cpp (target >= 0.6)": ratio(get("engine_int8", chat), get("llama_cpp", chat)),
        "int4_ttft_vs_llama_cpp (target <= 0.5)": ratio(get("engine_int4", "ttft_s"), get("llama_cpp", "ttft_s")),
        f"int4_aggregate_{streams}_vs_own_single_stream (target >= 8)": ratio(get("engine_int4", agg),
                                                                               get("engine_int4", chat)),
        f"int4_aggregate_{streams}_vs_llama_cpp_{streams}_streams (target >= 3)": ratio(
            get("engine_int4", agg), get("llama_cpp", agg)),
        f"int4_aggregate_{streams}_vs_llama_cpp_single_stream": ratio(get("engine_int4", agg), get("llama_cpp", chat)),
        f"int4_w8a8_aggregate_{streams}_vs_llama_cpp_{streams}_streams": ratio(get("engine_int4_w8a8", agg),
                                                                               get("llama_cpp", agg)),
        "int4_peak_rss_vs_fp32 (target <= 0.5)": ratio(get("engine_int4", "peak_rss_mib"),
                                                       get("engine_fp32", "peak_rss_mib")),
        "int4_w8a8_peak_rss_vs_fp32": ratio(get("engine_int4_w8a8", "peak_rss_mib"), get("engine_fp32", "peak_rss_mib")),
        f"int4_w8a8_aggregate_{streams}_vs_own_single_stream": ratio(get("engine_int4_w8a8", agg),
                                                                     get("engine_int4_w8a8", chat)),
        "int4_w8a8_aggregate_vs_int4": ratio(get("engine_int4_w8a8", agg), get("engine_int4", agg)),
        "int4_w8a8_ttft_vs_int4": ratio(get("engine_int4_w8a8", "ttft_s"), get("engine_int4", "ttft_s")),
        f"int8_aggregate_{streams}_vs_own_single_stream": ratio(get("engine_int8", agg), get("engine_int8", chat)),
        f"int8_w8a8_aggregate_{streams}_vs_own_single_stream": ratio(get("engine_int8_w8a8", agg),
                                                                     get("engine_int8_w8a8", chat)),
        "int4_compiled_decode_vs_llama_cpp": ratio(get("engine_int4_compiled", chat), get("llama_cpp", chat)),
        "int4_compiled_decode_vs_int4": ratio(get("engine_int4_compiled", chat), get("engine_int4", chat)),
        "int8_compiled_decode_vs_llama_cpp": ratio(get("engine_int8_compiled", chat), get("llama_cpp", chat)),
        f"int4_compiled_aggregate_{streams}_vs_own_single_stream": ratio(get("engine_int4_compiled", agg),
                                                                         get("engine_int4_compiled", chat)),
        f"int4_w8a8_compiled_aggregate_{streams}_vs_own_single_stream": ratio(
            get("engine_int4_w8a8_compiled", agg), get("engine_int4_w8a8_compiled", chat)),
        f"int4_w8a8_compiled_aggregate_{streams}_vs_llama_cpp_{streams}_streams": ratio(
            get("engine_int4_w8a8_compiled", agg), get("llama_cpp", agg)),
        f"int8_w8a8_compiled_aggregate_{streams}_vs_own_single_stream": ratio(
            get("engine_int8_w8a8_compiled", agg), get("engine_int8_w8a8_compiled", chat)),
        f"int8_w8a8_compiled_aggregate_{streams}_vs_llama_cpp_{streams}_streams": ratio(
            get("engine_int8_w8a8_compiled", agg), get("llama_cpp", agg)),
        "int4_decode_vs_fp32": ratio(get("engine_int4", chat), get("engine_fp32", chat)),
        "int4_decode_vs_hf_transformers": ratio(get("engine_int4", chat), get("hf_transformers", chat)),
    }
    for precision in PRECISIONS:
        for key in ("summarize", "chat"):
            out[f"{precision}_spec_on_vs_off_{key}"] = ratio(get(f"engine_{precision}_spec", f"decode_tokens_per_s_{key}"),
                                                             get(f"engine_{precision}", f"decode_tokens_per_s_{key}"))
    return out


def run_variant(variant: str, prompt_file: Path, tmp: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One variant in its own process (its peak RSS is its own)."""
    out = tmp / f"{variant}.json"
    cmd = [sys.executable, "-P", __file__, "--variant", variant, "--prompts", str(prompt_file),
           "--child-out", str(out), "--threads", str(args.threads), "--decode-tokens",
           str(args.decode_tokens), "--repeats", str(args.repeats), "--streams", str(args.streams),
           "--profile", args.profile, "--profile-threads", args.profile_threads,
           "--kv-cache-gib", str(args.kv_cache_gib)]
    start = time.perf_counter()
    done = subprocess.run(cmd, check=False, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    result: dict[str, Any] = json.loads(out.read_text()) if done.returncode == 0 else {"error": done.stderr.strip()[-1500:]}
    print(f"{variant}: {time.perf_counter() - start:.0f} s {result}", file=sys.stderr)
    return result


def median_variants(per_round: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Each variant's first round, its numeric figures replaced by their median over the rounds."""
    merged: dict[str, dict[str, Any]] = {}
    for variant, first in per_round[0].items():
        merged[variant] = dict(first)
        for key, value in first.items():
            values = [r[variant].get(key) for r in per_round]
            if isinstance(value, int | float) and not isinstance(value, bool) and all(
                    isinstance(v, int | float) for v in values):
                merged[variant][key] = statistics.median(values)
                if len(per_round) > 1:
                    merged[variant].setdefault("by_round", {})[key] = values
    return merged


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=550)
    # The same pool for every precision (bf16 fits twice the tokens): enough for 32 chat streams at fp32,
    # and small, since a pool is resident memory that would otherwise swamp the weights in peak RSS.
    parser.add_argument("--kv-cache-gib", type=float, default=0.15)
    parser.add_argument("--profile", default="int4", choices=list(PRECISIONS), help="precision to profile")
    parser.add_argument("--profile-threads", default="1,2", help="thread counts the step profile runs at")
    parser.add_argument("--variants", default=",".join(ENGINE_VARIANTS + PEERS))
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the variants this many times in turn; figures and ratios are medians over "
                             "rounds, each ratio's per-round values kept (this machine's load moves single "
                             "runs by 15-25%%)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # child mode
    parser.add_argument("--prompts", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        return run_child(args)

    prompts = build_prompts(args.prompt_tokens)
    report: dict[str, Any] = {"threads": args.threads, "decode_tokens": args.decode_tokens, "repeats": args.repeats,
                              "rounds": args.rounds, "streams": args.streams, "variants": {}}
    per_round: list[dict[str, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        prompt_file = Path(tmp) / "prompts.json"
        prompt_file.write_text(json.dumps(prompts))
        for _ in range(args.rounds):
            per_round.append({variant: run_variant(variant, prompt_file, Path(tmp), args)
                              for variant in args.variants.split(",")})
    report["variants"] = median_variants(per_round)
    report["ratios"] = ratios(report["variants"], args.streams)
    if args.rounds > 1:
        by_round = [ratios(r, args.streams) for r in per_round]
        report["ratios_by_round"] = {key: [r[key] for r in by_round] for key in by_round[0] if by_round[0][key] is not None}
    emit(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
