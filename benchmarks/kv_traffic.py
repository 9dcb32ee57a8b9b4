"""What a long context's K/V read costs a decode step, beyond the attention kernel's own time. JSON out.

    .venv/bin/python -P benchmarks/kv_traffic.py [--threads 2] [--context 2600] [--decode-tokens 32] [--out FILE]

The engine (its defaults: int4 weights, bf16 KV, the native paged-decode kernel where the start-up
measurement took it) decodes greedily after a prompt of --context tokens and after an 8-token prompt.
The short run is then repeated with one more call of the same kernel in every layer, on a pool of
--context keys that is not the engine's (its time is counted apart, as `added_ms`):
- `short_plus_stream`: a pool per layer, 30 in all: the long context's bytes, read as a step reads them;
- `short_plus_one_pool`: one such pool for every layer: the same bytes pass through each core's L2, but
  the footprint is one layer's (it stays in L3);
- `short_plus_hot`: a table of --context keys over 8 blocks: the same arithmetic on data in L1/L2;
- `short_plus_stream_int8`: as short_plus_stream, the pools as int8 codes with per-(slot, head) scales
  (native_decode.paged_decode_int8): what a K/V cache of half the bytes would cost the step.
Per run: the step's median wall time, the engine's own kernel calls (`kernel_ms`) and the rest of the
step (`rest_ms` = step - kernel - added). So `rest_ms` of short_plus_stream minus short's is what the
long context's traffic costs the other ops (cache eviction), which no kernel micro-benchmark shows.
The kernel calls are timed by wrapping native_decode.paged_decode (the engine's only caller of the kernel).
Every figure is one run on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from decodeservice.engine import Engine, SamplingParams
from decodeservice.engine.attention import native_decode

TEXT = ("Chapter. The survey team walked the northern ridge at dawn, logging every spring, path and ruined wall "
        "they passed. ")
SHORT = 8


@dataclass
class Clock:
    kernel_s: float = 0.0
    added_s: float = 0.0
    calls: int = 0


@dataclass(frozen=True)
class ExtraPools:
    """A kernel call added to every layer: pools[i % len(pools)] read through `table` over `length` keys.
    A pool is (K, V) in the cache's dtype, or (K codes, K scales, V codes, V scales) for int8."""

    pools: list[tuple[torch.Tensor, ...]]
    table: torch.Tensor
    length: torch.Tensor


def extra_pools(kind: str, *, context: int, layers: int, block_size: int, kv_heads: int, head_dim: int,
                dtype: torch.dtype) -> ExtraPools:
    gen = torch.Generator().manual_seed(0)
    blocks = -(-context // block_size)
    count = 1 if kind in ("one_pool", "hot") else layers
    pools: list[tuple[torch.Tensor, ...]] = [
        tuple(torch.randn(blocks + 1, block_size, kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2))
        for _ in range(count)]
    if kind == "stream_int8":
        pools = [(*native_decode.quantize_kv(k), *native_decode.quantize_kv(v)) for k, v in pools]
    order = torch.randperm(blocks, generator=gen) if kind != "hot" else torch.arange(blocks) % 8
    return ExtraPools(pools=pools, table=(order + 1).to(torch.int32).view(1, -1),
                      length=torch.tensor([context], dtype=torch.int32))


@contextmanager
def timed_kernel(clock: Clock, extra: ExtraPools | None) -> Iterator[None]:
    original = native_decode.paged_decode

    def wrapped(q: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        start = time.perf_counter()
        out = original(q, *args, **kwargs)
        clock.kernel_s += time.perf_counter() - start
        if extra is not None:
            pool = extra.pools[clock.calls % len(extra.pools)]
            start = time.perf_counter()
            if len(pool) == 4:
                native_decode.paged_decode_int8(q, *pool, extra.table, extra.length, module=kwargs["module"])
            else:
                original(q, *pool, extra.table, extra.length, module=kwargs["module"])
            clock.added_s += time.perf_counter() - start
        clock.calls += 1
        return out

    native_decode.paged_decode = wrapped  # type: ignore[assignment]
    try:
        yield
    finally:
        native_decode.paged_decode = original


def decode_steps(engine: Engine, tokens: list[int], new_tokens: int, extra: ExtraPools | None) -> dict[str, float]:
    """Median per decode step (the prompt's step left out) of the wall time, the kernel and the added calls."""
    engine.add_request(tokens, SamplingParams(max_tokens=new_tokens + 1, temperature=0.0, ignore_eos=True))
    engine.step()  # the prompt
    samples: list[tuple[float, Clock]] = []
    while engine.has_unfinished_requests():
        clock = Clock()
        with timed_kernel(clock, extra):
            start = time.perf_counter()
            engine.step()
            samples.append((time.perf_counter() - start, clock))

    def median_ms(pick: Callable[[tuple[float, Clock]], float]) -> float:
        return round(statistics.median(pick(s) for s in samples) * 1e3, 3)

    step, kernel, added = median_ms(lambda s: s[0]), median_ms(lambda s: s[1].kernel_s), median_ms(lambda s: s[1].added_s)
    return {"step_ms": step, "kernel_ms": kernel, "added_ms": added, "rest_ms": round(step - kernel - added, 3),
            "kernel_calls_per_step": samples[-1][1].calls}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=2600)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2, help="every run this many times, interleaved; best kept")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine.from_pretrained("smollm2-135m", max_model_len=args.context + args.decode_tokens + 64)
    backend = engine.runner.attention_backend
    if getattr(backend, "kernel", None) is None:
        print("the engine does not run the native paged-decode kernel here; nothing to measure", file=sys.stderr)
        return 2
    ids = engine.tokenizer.encode(TEXT * (args.context // 20 + 1), add_special_tokens=False)
    k_cache = engine.runner.kv_caches[0][0]
    shape = {"context": args.context, "layers": len(engine.runner.kv_caches), "block_size": k_cache.shape[1],
             "kv_heads": k_cache.shape[2], "head_dim": k_cache.shape[3], "dtype": k_cache.dtype}
    runs: dict[str, tuple[list[int], ExtraPools | None]] = {
        "short": (ids[:SHORT], None), "long": (ids[: args.context], None),
        **{f"short_plus_{kind}": (ids[:SHORT], extra_pools(kind, **shape)) for kind in ("stream", "one_pool", "hot", "stream_int8")}}
    decode_steps(engine, ids[:SHORT], 4, None)  # warm-up
    best: dict[str, dict[str, float]] = {}
    for _ in range(args.rounds):
        for name, (tokens, extra) in runs.items():
            result = decode_steps(engine, tokens, args.decode_tokens, extra)
            if name not in best or result["step_ms"] < best[name]["step_ms"]:
                best[name] = result
    rest = {name: r["rest_ms"] for name, r in best.items()}
    report = {
        "threads": args.threads, "context": args.context, "kv_cache_dtype": str(shape["dtype"]),
        "kv_bytes_per_step": 2 * args.context * shape["layers"] * shape["kv_heads"] * shape["head_dim"]
        * k_cache.element_size(),
        "runs": best,
        "decode_ratio_long_vs_short": round(best["short"]["step_ms"] / best["long"]["step_ms"], 3),
        "rest_growth_ms": {"long": round(rest["long"] - rest["short"], 3),
                           "stream": round(rest["short_plus_stream"] - rest["short"], 3),
                           "one_pool": round(rest["short_plus_one_pool"] - rest["short"], 3),
                           "hot": round(rest["short_plus_hot"] - rest["short"], 3),
                           "stream_int8": round(rest["short_plus_stream_int8"] - rest["short"], 3)},
        "int8_vs_bf16_stream_step_ms": round(best["short_plus_stream_int8"]["step_ms"]
                                             - best["short_plus_stream"]["step_ms"], 3),
        "note": "one run on a machine shared with other jobs; best of --rounds per run, by step time",
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
