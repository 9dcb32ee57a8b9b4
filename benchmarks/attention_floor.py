"""What long-context attention can cost on this machine at best, next to what the engine's path costs. JSON out.

    .venv/bin/python -P benchmarks/attention_floor.py [--threads 1] [--contexts 512,1024,2048,4096]
        [--repeats 5] [--skip-engine] [--out FILE]

The long-context targets ask for decode at 4k keys at 0.85x the engine's short-context decode and for prefill
throughput flat within 15% from 0.5k to 4k. This measures how far either can go here, at the bundled
model's shapes (30 layers, 9 query heads, 3 K/V heads, D 64, bf16 K/V as the int4 engine keeps them):

- decode, per layer and per context L, on 30 separate pools read in turn, so each call meets keys that
  are not in cache, as in the engine: `read_floor_us`, the fastest pass over the layer's K and V bytes
  (the least any exact kernel must spend); `shipped_us`, the engine's path at L (the native paged kernel
  where it is built, else the plain gather + SDPA path); `flash_us`; `int8_scores_us`, the score GEMM alone
  if K were stored as int8 (`torch._int_mm`, the only stock kernel here that reads less), for scale.
  With --inductor, `inductor_us`: the same decode as plain tensor math compiled by torch.compile.
  `best_ratio_vs_short` = short step / (short step + 30 x read_floor_us): decode at L over decode at a
  few keys if attention cost nothing beyond reading K and V once. Without --skip-engine the short step
  is the bundled engine's own (default precision, best of two 32-token decodes after 8 tokens).
- prefill: multiply-adds per prompt token in the projections (fixed) and in causal attention (growing
  with L), each at its measured bf16 rate here (a 512-row GEMM at the gate/up shape; the flash kernel,
  512 queries over L keys), and the best throughput at 4k over 0.5k those rates allow, and would
  allow were attention as fast per multiply-add as the GEMM.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from decodeservice.engine.attention import gather, native_decode
from decodeservice.engine.attention.metadata import SequenceSpan, SlotRun

sys.path.insert(0, str(Path(__file__).parent))  # `python -P` leaves the script's folder off the path
from json_out import emit

LAYERS, HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTERMEDIATE = 30, 9, 3, 64, 576, 1536
DTYPE = torch.bfloat16
_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def per_layer_us(fn: Callable[[int], object], repeats: int) -> float:
    """Best over `repeats` of one pass over the 30 layers, per layer."""
    fn(0)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for layer in range(LAYERS):
            fn(layer)
        best = min(best, time.perf_counter() - start)
    return best / LAYERS * 1e6


def compiled_decode() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """Decode attention written as plain tensor math for inductor to fuse (q (Hkv, G, D), k/v (L, Hkv, D))."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        scores = (k.float().unsqueeze(2) * q.float().unsqueeze(0)).sum(-1) * HEAD_DIM**-0.5  # (L, Hkv, G)
        weights = torch.exp(scores - scores.amax(0, keepdim=True))
        out = (weights.unsqueeze(-1) * v.float().unsqueeze(2)).sum(0)  # (Hkv, G, D)
        return (out / weights.sum(0).unsqueeze(-1)).to(q.dtype)

    return torch.compile(attend, dynamic=True)


def decode_costs(length: int, repeats: int, inductor: Callable[..., torch.Tensor] | None = None
                 ) -> dict[str, float]:
    gen = torch.Generator().manual_seed(length)
    slots = (length // 16 + 1) * 16  # whole pool blocks of 16 slots, past the last key
    keys = [torch.randn(slots, KV_HEADS, HEAD_DIM, generator=gen).to(DTYPE) for _ in range(LAYERS)]
    values = [torch.randn(slots, KV_HEADS, HEAD_DIM, generator=gen).to(DTYPE) for _ in range(LAYERS)]
    q = torch.randn(1, HEADS, HEAD_DIM, generator=gen).to(DTYPE)
    table = torch.arange(slots // 16)  # the slots as pool blocks of 16, read through a table as in a step
    span = SequenceSpan(token_start=0, num_new=1, context_len=length, runs=(SlotRun(first_slot=0, length=length),),
                        block_table=table)
    kernel = native_decode.decode_extension()
    lengths = torch.tensor([length], dtype=torch.int32)

    def read(i: int) -> object:  # int16 views: a max over the raw bits, no bf16 arithmetic in the way
        return keys[i][:length].view(torch.int16).max(), values[i][:length].view(torch.int16).max()

    def shipped(i: int) -> object:
        k_pool, v_pool = keys[i].view(-1, 16, KV_HEADS, HEAD_DIM), values[i].view(-1, 16, KV_HEADS, HEAD_DIM)
        if kernel is not None:
            return native_decode.paged_decode(q, k_pool, v_pool, table.to(torch.int32).view(1, -1), lengths, module=kernel)
        return gather.attend_span(q, k_pool, v_pool, span)

    folded = q.view(1, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM).permute(1, 2, 0, 3).reshape(1, KV_HEADS, -1, HEAD_DIM)

    def flash(i: int) -> object:
        return _flash(folded, keys[i][:length].permute(1, 0, 2).unsqueeze(0),
                      values[i][:length].permute(1, 0, 2).unsqueeze(0))

    keys_int8 = [torch.randint(-127, 128, (length, KV_HEADS * HEAD_DIM), dtype=torch.int8, generator=gen)
                 for _ in range(LAYERS)]
    rows_int8 = torch.randint(-127, 128, (HEADS, KV_HEADS * HEAD_DIM), dtype=torch.int8, generator=gen)
    row = {"read_floor_us": per_layer_us(read, repeats), "shipped_us": per_layer_us(shipped, repeats),
           "flash_us": per_layer_us(flash, repeats),
           "int8_scores_us": per_layer_us(lambda i: torch._int_mm(rows_int8, keys_int8[i].t()), repeats)}
    if inductor is not None:
        grouped = q.view(KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)
        row["inductor_us"] = per_layer_us(lambda i: inductor(grouped, keys[i][:length], values[i][:length]), repeats)
    return row


def prefill_bound(contexts: list[int], repeats: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1)
    rows = torch.randn(512, HIDDEN, generator=gen).to(DTYPE)
    weight = torch.randn(2 * INTERMEDIATE, HIDDEN, generator=gen).to(DTYPE)
    gemm_s = per_layer_us(lambda _: torch.nn.functional.linear(rows, weight), repeats) / 1e6
    projection_rate = 512 * 2 * INTERMEDIATE * HIDDEN / gemm_s  # multiply-adds per second
    per_layer_projection = (HIDDEN * (HEADS + 2 * KV_HEADS) * HEAD_DIM + HEADS * HEAD_DIM * HIDDEN
                            + 3 * HIDDEN * INTERMEDIATE)  # multiply-adds per token per layer
    out: dict[str, Any] = {"projection_macs_per_s": projection_rate, "contexts": {}}
    cost: dict[int, float] = {}
    at_projection_rate: dict[int, float] = {}
    for length in contexts:
        q = torch.randn(1, HEADS, 512, HEAD_DIM, generator=gen).to(DTYPE)
        k = torch.randn(1, HEADS, length, HEAD_DIM, generator=gen).to(DTYPE)
        # 512 queries over L cached keys, unmasked: the engine's prefix piece for a prompt chunk
        # (paged_views.py), the bulk of its prefill attention.
        def chunk(_: int, q: torch.Tensor = q, k: torch.Tensor = k) -> object:
            return _flash(q, k, k)

        attn_s = per_layer_us(chunk, max(2, repeats // 2)) / 1e6
        attention_rate = 2 * HEADS * HEAD_DIM * 512 * length / attn_s
        # Causal attention per token of an L-token prompt, on average: L/2 keys, QK and PV.
        attention_macs = 2 * HEADS * HEAD_DIM * length / 2
        cost[length] = per_layer_projection / projection_rate + attention_macs / attention_rate
        at_projection_rate[length] = (per_layer_projection + attention_macs) / projection_rate
        out["contexts"][str(length)] = {"attention_macs_per_s": attention_rate,
                                        "attention_share_of_token": attention_macs / attention_rate / cost[length]}
    shortest, longest = min(contexts), max(contexts)
    out["best_throughput_longest_over_shortest"] = cost[shortest] / cost[longest]
    # Were attention as fast per multiply-add as the projections' GEMM (it is not, on any kernel here):
    out["best_if_attention_ran_at_projection_rate"] = at_projection_rate[shortest] / at_projection_rate[longest]
    return out


def short_step_ms() -> float | None:
    from decodeservice.engine import Engine, SamplingParams

    engine = Engine.from_pretrained("smollm2-135m")
    prompt = engine.tokenizer.encode("Question: what did the team log on the ridge?", add_special_tokens=False)[:8]
    best = float("inf")
    for _ in range(3):  # the first one warms up
        params = SamplingParams(max_tokens=33, temperature=0.0, ignore_eos=True)
        engine.add_request(prompt, params)
        first = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if first is None and out.new_token_ids:
                    first = time.perf_counter()
        assert first is not None
        best = min(best, (time.perf_counter() - first) / 32)
    return best * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--contexts", default="512,1024,2048,4096")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-engine", action="store_true", help="no short-step measurement (no model load)")
    parser.add_argument("--inductor", action="store_true",
                        help="also decode attention as plain tensor math compiled by inductor (needs a C++ compiler)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    contexts = [int(c) for c in args.contexts.split(",")]
    result: dict[str, Any] = {"threads": args.threads, "kv_dtype": "bfloat16", "load_average_1min_at_start":
                              os.getloadavg()[0]}
    step = None if args.skip_engine else short_step_ms()
    result["engine_short_decode_step_ms"] = step
    decode: dict[str, Any] = {}
    inductor = compiled_decode() if args.inductor else None
    for length in contexts:
        row: dict[str, Any] = decode_costs(length, args.repeats, inductor)
        row["read_floor_ms_per_step"] = LAYERS * row["read_floor_us"] / 1e3
        row["shipped_ms_per_step"] = LAYERS * row["shipped_us"] / 1e3
        if step is not None:
            row["best_ratio_vs_short"] = step / (step + row["read_floor_ms_per_step"])
            row["shipped_ratio_vs_short_if_nothing_else_grew"] = step / (step + row["shipped_ms_per_step"])
        decode[str(length)] = row
    result["decode"] = decode
    result["prefill"] = prefill_bound(contexts, args.repeats)
    result["load_average_1min_at_end"] = os.getloadavg()[0]
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
