"""What a decode step gains between a short and a long context, part by part. JSON out.

    .venv/bin/python -P benchmarks/decode_step_by_context.py [--threads 2] [--contexts 8,2600] [--rounds 4]
        [--kv-cache-dtype auto] [--out FILE]

One engine at its defaults (the bundled model). Per round and context: a prompt it has not seen,
three tokens to leave the prefill behind, then --decode-tokens decode steps timed as a whole and in
parts: the q/k/v projection with RoPE (`Attention.project`), attention over the cache (`attend`; the
native paged-decode kernel inside it separately), o_proj, the MLP, the head (`compute_logits`), and
the forward as a whole (`run_layers`). The parts are wall time around each call, milliseconds per
step; the round with the fastest step is kept per context. `growth` is long minus short: the kernel's
share is the cost of reading the longer cache, and a projection or MLP that slows down with the
context reads weights that the cache's stream has pushed out of the CPU's caches.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from decodeservice.engine import Engine, SamplingParams
from decodeservice.engine import model as model_module
from decodeservice.engine.attention import native_decode
from decodeservice.engine.quant import detect_cpu

sys.path.insert(0, str(Path(__file__).parent))  # `python -P` leaves the script's folder off the path
from json_out import emit
from long_context import document_tokens

spent: collections.defaultdict[str, float] = collections.defaultdict(float)


def timed(owner: Any, attribute: str, part: str) -> None:
    """owner.attribute wrapped so that its wall time adds to spent[part]."""
    original: Callable[..., Any] = getattr(owner, attribute)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent[part] += time.perf_counter() - start

    setattr(owner, attribute, wrapper)


def decode_parts(engine: Engine, tokens: list[int], decode_tokens: int) -> dict[str, float]:
    """Milliseconds per decode step, by part, over one request's decode."""
    engine.add_request(tokens, SamplingParams(max_tokens=decode_tokens + 3, temperature=0.0, ignore_eos=True))
    produced = 0
    while produced < 3:  # the prefill (chunked for long prompts) and two decodes: not timed
        produced += sum(len(out.new_token_ids) for out in engine.step())
    spent.clear()
    steps = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    spent["step"] += time.perf_counter() - start
    return {part: seconds / steps * 1e3 for part, seconds in spent.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--contexts", default="8,2600")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    contexts = [int(c) for c in args.contexts.split(",")]
    engine = Engine.from_pretrained("smollm2-135m", max_model_len=max(contexts) + args.decode_tokens + 64,
                                    kv_cache_dtype=args.kv_cache_dtype)
    timed(model_module.Attention, "project", "qkv_projection_and_rope")
    timed(model_module, "attend", "attention")
    timed(native_decode, "paged_decode", "paged_decode_kernel")
    timed(native_decode, "paged_decode_int8", "paged_decode_kernel")
    timed(model_module.MLP, "forward", "mlp")
    timed(model_module.LlamaModel, "run_layers", "forward")
    timed(model_module.LlamaModel, "compute_logits", "head")
    for layer in engine.model.decoder_layers():
        timed(layer.self_attn.o_proj, "forward", "o_proj")
    decode_parts(engine, document_tokens(engine, 16, offset=10**6), 4)  # warm-up
    best: dict[int, dict[str, float]] = {}
    for r in range(args.rounds):
        for n in contexts:
            parts = decode_parts(engine, document_tokens(engine, n, offset=1000 * (r + 1) + n), args.decode_tokens)
            if n not in best or parts["step"] < best[n]["step"]:
                best[n] = parts
    short, long = best[min(contexts)], best[max(contexts)]
    result = {
        "threads": args.threads, "rounds": args.rounds, "decode_tokens": args.decode_tokens,
        "cpu": torch.backends.cpu.get_cpu_capability(), "cpu_model": detect_cpu().model_name,
        "activations": str(engine.dtype).removeprefix("torch."), "kv": str(engine.kv_dtype).removeprefix("torch."),
        "load_average_1min": os.getloadavg()[0],
        "ms_per_step": {str(n): parts for n, parts in best.items()},
        "growth_ms": {part: long.get(part, 0.0) - short.get(part, 0.0) for part in long},
        "decode_long_vs_short": short["step"] / long["step"],
    }
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
