"""EngineConfig(compile=True) against eager: decode step time, start-up, bit-identity. JSON out.

    .venv/bin/python -P benchmarks/decode_compile.py [--quantization int4] [--w8a8] [--threads 1]
        [--streams 1,32] [--rounds 5] [--out FILE]

One engine is built with compile=True (its start-up, which compiles every graph, is timed: cold the
first time on a machine, from inductor's on-disk cache after). For each batch size, `streams` chat
requests decode together, and the runner's step is switched between the compiled graph and the eager
forward every 6 steps, `rounds` times: the two share the same requests, pool and load, so the ratio is
fair on a noisy machine. Per batch: median step time of each round, both ways (ms), their minimums and
ratio, and whether the compiled forward's logits equal eager's on the same step (bit for bit).
Then `single_stream_end_to_end`: chat decode tokens/s of the compiled engine against an eager engine on
the same weights, alternating requests.

engine/compiled_step.py has the design; it replaced per-layer graphs (attention as a graph break), an
earlier study of this script that git history keeps.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from decodeservice.engine import Engine, SamplingParams

sys.path.insert(0, str(Path(__file__).parent))  # `python -P` leaves the script's folder off the path
from json_out import emit


def step_times(engine: Engine, streams: int, rounds: int, steps: int = 6) -> dict[str, Any]:
    runner = engine.runner
    compiled = runner.compiled
    assert compiled is not None
    chat = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Tell me about the moon."}])
    params = SamplingParams(max_tokens=(2 * rounds + 2) * steps + 4, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(f"{i}: {chat}", params) for i in range(streams)]
    started: set[str] = set()
    while len(started) < streams:  # prompts run eager either way (more than MAX_ROWS rows)
        started.update(o.request_id for o in engine.step() if o.new_token_ids)

    batch, _ = runner.build_batch(engine.scheduler.schedule().scheduled)
    kv = runner.kv_caches
    with torch.inference_mode():  # the same step both ways; each writes the same K/V to the same slots
        identical = torch.equal(engine.model.compute_logits(compiled(batch, kv)),
                                engine.model.compute_logits(engine.model.forward(batch, kv)))
    samples: dict[str, list[float]] = {"compiled": [], "eager": []}
    for _ in range(rounds):
        for name, step in (("compiled", compiled), ("eager", None)):
            runner.compiled = step
            walls = []
            for _ in range(steps):
                t0 = time.perf_counter()
                engine.step()
                walls.append((time.perf_counter() - t0) * 1000)
            samples[name].append(round(statistics.median(walls), 2))
    runner.compiled = compiled
    for request_id in ids:
        engine.abort_request(request_id)
    best = {name: min(v) for name, v in samples.items()}
    return {"step_ms_medians_by_round": samples, "step_ms_min": best,
            "compiled_vs_eager_step_time": round(best["compiled"] / best["eager"], 3),
            "logits_bit_identical": identical}


def end_to_end(compiled: Engine, rounds: int) -> dict[str, Any]:
    """Single-stream chat decode tokens/s, compiled vs an eager engine on the same weights, alternating."""
    eager = Engine(model=compiled.model, tokenizer=compiled.tokenizer,
                   config=dataclasses.replace(compiled.config, compile=False))
    chat = compiled.tokenizer.apply_chat_template([{"role": "user", "content": "Tell me about the moon."}])

    def rate(engine: Engine, tokens: int = 48) -> float:
        engine.add_request(chat, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
        first = None
        while engine.has_unfinished_requests():
            outs = engine.step()
            if first is None and outs and outs[0].new_token_ids:
                first = time.perf_counter()
        assert first is not None
        return (tokens - 1) / (time.perf_counter() - first)

    rate(compiled), rate(eager)
    pairs = [(rate(compiled), rate(eager)) for _ in range(rounds)]
    return {"compiled_tokens_per_s_median": round(statistics.median(c for c, _ in pairs), 2),
            "eager_tokens_per_s_median": round(statistics.median(e for _, e in pairs), 2),
            "compiled_vs_eager_median_of_pairs": round(statistics.median(c / e for c, e in pairs), 3)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quantization", default="int4", choices=["int8", "int4"])
    parser.add_argument("--w8a8", action="store_true")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--streams", default="1,32")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    engine = Engine.from_pretrained("smollm2-135m", quantization=args.quantization, enable_prefix_caching=False,
                                    max_model_len=2048, kv_cache_gib=0.15, compile=True, w8a8=args.w8a8)
    report: dict[str, Any] = {"torch": torch.__version__, "threads": args.threads, "weights": engine.model.weight_format,
                              "w8a8": args.w8a8, "engine_start_s_with_compile": round(time.perf_counter() - start, 1),
                              "batches": {}}
    for streams in (int(s) for s in args.streams.split(",")):
        report["batches"][f"streams_{streams}"] = step_times(engine, streams, args.rounds)
        print(f"streams {streams}: {report['batches'][f'streams_{streams}']}", file=sys.stderr)
    report["single_stream_end_to_end"] = end_to_end(engine, rounds=6)
    emit(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
