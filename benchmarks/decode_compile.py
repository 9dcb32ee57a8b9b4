"""Does torch.compile (inductor, CPU) speed up the decode step? Eager vs two compiled layouts. JSON out.

    .venv/bin/python -P benchmarks/decode_compile.py [--quantization int4] [--threads 1] [--streams 1,32]

The engine is not compiled (EngineConfig has no such option) because this study found no win worth
the start-up (benchmarks/results/decode_compile_cpu1.json). Layouts, each over the loaded model and a
real step's batch (so attention reads the paged pool as in serving):
- `layer`: each decoder layer compiled whole, attention (`attend`, which reads Python metadata) left
  out as a graph break: two graphs per layer call;
- `boundary`: the non-attention work between two attentions (o_proj + residual + norm + MLP + residual,
  then the next layer's norm + QKV + rope) as one graph: one call per layer, the most fusion possible
  with attention outside.
Per layout and batch: compile + first call (s), the forward's time (min and median of interleaved
repeats, ms), the largest difference of the final hidden states from eager, and whether the greedy
tokens agree. Then `single_stream_end_to_end`: EngineConfig(compile=True) (the boundary layout on one-row
steps) against eager, chat decode tokens/s, alternating requests. Default dynamic=False: one graph per batch size (serving would pad to buckets); --dynamic:
one graph with a symbolic batch size for all.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from decodeservice.engine import Engine, SamplingParams
from decodeservice.engine.attention import attend
from decodeservice.engine.model import DecoderLayer, ForwardBatch, LlamaModel

Forward = Callable[[ForwardBatch, list[tuple[torch.Tensor, torch.Tensor]]], torch.Tensor]
Rope = tuple[torch.Tensor, torch.Tensor]
_attend = torch.compiler.disable(attend)


def layer_step(layer: DecoderLayer, h: torch.Tensor, batch: ForwardBatch, rope: Rope, k_cache: torch.Tensor,
               v_cache: torch.Tensor) -> torch.Tensor:
    attn = layer.self_attn
    q, k, v = attn.project(layer.input_layernorm(h), rope)
    h = h + attn.o_proj(_attend(q, k, v, k_cache, v_cache, batch.attn).reshape(h.shape[0], attn.q_size))
    return h + layer.mlp(layer.post_attention_layernorm(h))


def enter(layer: DecoderLayer, h: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, ...]:
    return layer.self_attn.project(layer.input_layernorm(h), rope)


def boundary(layer: DecoderLayer, after: DecoderLayer, h: torch.Tensor, attended: torch.Tensor, rope: Rope
             ) -> tuple[torch.Tensor, ...]:
    h = h + layer.self_attn.o_proj(attended.reshape(h.shape[0], layer.self_attn.q_size))
    h = h + layer.mlp(layer.post_attention_layernorm(h))
    return (h, *after.self_attn.project(after.input_layernorm(h), rope))


def leave(layer: DecoderLayer, h: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
    h = h + layer.self_attn.o_proj(attended.reshape(h.shape[0], layer.self_attn.q_size))
    return h + layer.mlp(layer.post_attention_layernorm(h))


def per_layer_forward(model: LlamaModel, step: Callable[..., torch.Tensor]) -> Forward:
    def forward(batch: ForwardBatch, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        h = model.embed_tokens(batch.input_ids)
        rope = model.rotary.tables(batch.positions, h.dtype)
        for layer, (k_cache, v_cache) in zip(model.decoder_layers(), kv, strict=True):
            h = step(layer, h, batch, rope, k_cache, v_cache)
        return model.norm(h[batch.logits_index])
    return forward


def boundary_forward(model: LlamaModel, compile_fn: Callable[[Any], Any]) -> Forward:
    first, middle, last = compile_fn(enter), compile_fn(boundary), compile_fn(leave)

    def forward(batch: ForwardBatch, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        layers = model.decoder_layers()
        h = model.embed_tokens(batch.input_ids)
        rope = model.rotary.tables(batch.positions, h.dtype)
        q, k, v = first(layers[0], h, rope)
        for i, (k_cache, v_cache) in enumerate(kv):
            attended = attend(q, k, v, k_cache, v_cache, batch.attn)
            if i + 1 < len(layers):
                h, q, k, v = middle(layers[i], layers[i + 1], h, attended, rope)
            else:
                h = last(layers[i], h, attended)
        return model.norm(h[batch.logits_index])
    return forward


def measure(engine: Engine, streams: int, rounds: int, *, dynamic: bool) -> dict[str, Any]:
    model = engine.model
    chat = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Tell me about the moon."}])
    ids = [engine.add_request(f"{i}: {chat}", SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
           for i in range(streams)]
    started: set[str] = set()
    while len(started) < streams:
        started.update(o.request_id for o in engine.step() if o.new_token_ids)
    batch, _ = engine.runner.build_batch(engine.scheduler.schedule().scheduled)
    kv = engine.runner.kv_caches
    compile_fn = torch.compile(dynamic=dynamic)
    variants: dict[str, Forward] = {"eager": per_layer_forward(model, layer_step),
                                    "layer": per_layer_forward(model, compile_fn(layer_step)),
                                    "boundary": boundary_forward(model, compile_fn)}
    out: dict[str, Any] = {}
    with torch.inference_mode():
        reference = variants["eager"](batch, kv)
        for name, forward in variants.items():
            t0 = time.perf_counter()
            hidden = forward(batch, kv)
            out[name] = {"first_call_s": round(time.perf_counter() - t0, 2),
                         "max_abs_diff_vs_eager": float((hidden.float() - reference.float()).abs().max()),
                         "same_greedy_tokens": bool(torch.equal(model.compute_logits(hidden).argmax(-1),
                                                                model.compute_logits(reference).argmax(-1)))}
        samples: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(rounds):
            for name, forward in variants.items():
                t0 = time.perf_counter()
                forward(batch, kv)
                samples[name].append((time.perf_counter() - t0) * 1000)
    for name, times in samples.items():
        out[name] |= {"forward_ms_min": round(min(times), 2), "forward_ms_median": round(statistics.median(times), 2)}
    for request_id in ids:
        engine.abort_request(request_id)
    return out


def end_to_end(compiled: Engine, rounds: int) -> dict[str, Any]:
    """Single-stream chat decode tokens/s, EngineConfig(compile=True) vs an eager engine on the same
    weights, alternating request by request (the machine's load hits both alike)."""
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
    parser.add_argument("--quantization", default="int4", choices=["none", "int8", "int4"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--streams", default="1,32")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--dynamic", action="store_true", help="symbolic batch size: one graph for every batch")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine.from_pretrained("smollm2-135m", quantization=args.quantization, enable_prefix_caching=False,
                                    max_model_len=2048, kv_cache_gib=0.15)
    report: dict[str, Any] = {"torch": torch.__version__, "threads": args.threads, "dynamic": args.dynamic,
                              "weights": engine.model.weight_format, "batches": {}}
    for streams in (int(s) for s in args.streams.split(",")):
        report["batches"][f"streams_{streams}"] = measure(engine, streams, args.rounds, dynamic=args.dynamic)
        print(f"streams {streams}: {report['batches'][f'streams_{streams}']}", file=sys.stderr)
    start = time.perf_counter()
    compiled = Engine.from_pretrained("smollm2-135m", quantization=args.quantization, enable_prefix_caching=False,
                                      max_model_len=2048, kv_cache_gib=0.15, compile=True)
    report["engine_compile_true_start_s"] = round(time.perf_counter() - start, 1)
    report["single_stream_end_to_end"] = end_to_end(compiled, rounds=8)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
