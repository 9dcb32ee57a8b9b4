"""Speculation on (its defaults: n-gram, adaptive, step costs measured at start-up) against off, in rounds.

    .venv/bin/python -P benchmarks/spec_on_off.py [--dispatch native,avx2] [--rounds 4] [--max-tokens 32]
        [--concurrency 1,4,16] [--workloads mixed,chat,open,input_grounded] [--rounds-at-16 2] [--out FILE]

The defaults are the whole matrix (four workloads, 1, 4 and 16 streams, both CPU dispatches) sized to
run in about 8 minutes per dispatch on 2 cores: 32 tokens per request, 4 rounds, 2 at 16 streams (a
16-stream cell is 16 prompts' prefill and 512 tokens a side). Workloads: `mixed` and `chat` are the
shipped bench datasets (loadgen/datasets, the demo's and `decodectl bench`'s), `open` the open-ended
chat questions and `input_grounded` the whole-text edits of benchmarks/spec_decode.py. Two engines share
one model's weights, one with speculation off and one on. Each round sends every (workload, concurrency)
cell's requests to both, one after the other, the order alternating from cell to cell and from round to
round, so the machine's load drifts over both alike; a cell uses prompts no earlier cell used where the
dataset has enough (a prompt sent before would be a prefix-cache hit; the open-ended and input-grounded
sets, 4 and 8 prompts, wrap). Requests are greedy with ignore_eos (as `decodectl bench` sends them), so
both engines decode the same number of tokens and must give the same text.

Per cell: output tokens per wall second of the closed loop (prefill included), mean decode tokens/s per
request and output tokens per CPU second of this process, on / off in each round, their median, min and
max over rounds; acceptance and the share of decode steps that drafted. A cell whose rounds' ratios
straddle 1.0 is within this machine's noise. And where the on-path spends its time (`breakdown`): each
engine's steps timed one by one, the on-engine's split into steps that verified drafts and steps that
did not, each kind's tokens per ms against the off-engine's; the decoder's own counters (time in
propose and settle, shadow drafts and their hits, requests that started or stopped drafting); drafts
verified and accepted per request over its life; and the plain step time the policy's curve assumes
against what the off-engine's steps took. The load average is recorded before and after.
`--dispatch avx2` reruns in a child under ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
MKL_ENABLE_INSTRUCTIONS=AVX2. JSON out (benchmarks/results/spec_on_off.json).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))  # `python -P` leaves the script's folder off the path

from dispatches import caps_in_effect, report, run_child
from spec_decode import workload_messages

from decodeservice.loadgen.dataset import load_dataset

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = ("mixed", "chat", "open", "input_grounded")


@dataclass(frozen=True, kw_only=True)
class CellRun:
    output_tok_s: float  # all output tokens / wall seconds of the closed loop
    decode_tok_s: float  # mean over requests of (tokens - 1) / (finish - first token)
    wall_s: float
    # output tokens / CPU seconds of this process: steadier than wall time where others load the machine
    cpu_tok_s: float
    output_tokens: int
    decode_steps: int
    drafting_steps: int  # steps in which some sequence verified drafts
    draft_tokens: int
    accepted_tokens: int
    # Steps timed one by one: plain (no drafts verified) and drafting, their count, ms and the tokens they
    # gave (a stream's token each, plus the accepted drafts); prefill steps fall among the plain ones.
    plain_steps: int
    plain_ms: float
    plain_tokens: int
    drafting_ms: float
    drafting_tokens: int
    # Sequences in the engine summed over steps: over decode_steps, the mean batch. Where requests come
    # together and nothing waits, drafting streams finish first and leave the rest smaller batches.
    stream_steps: int


def conversations(workload: str) -> list[list[dict[str, str]]]:
    """The workload's chat messages, in a fixed order (datasets: a seeded shuffle)."""
    if workload in ("mixed", "chat"):
        entries = [e for e in load_dataset(workload) if e.messages is not None]
        random.Random(0).shuffle(entries)
        return [[{"role": m.role, "content": m.content} for m in e.messages or ()] for e in entries]
    name = {"open": "open_ended", "input_grounded": "input_grounded"}[workload]
    return [[{"role": "user", "content": m}] for m in workload_messages(name)]


def run_cell(engine: Any, prompts: list[str], *, concurrency: int, max_tokens: int) -> tuple[CellRun, list[list[int]]]:
    """Closed loop: keep `concurrency` requests in flight until every prompt is done. Also the outputs'
    token ids, in prompt order."""
    from decodeservice.engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    before = engine.stats().spec_decode
    pending = list(enumerate(prompts))
    in_flight: dict[str, int] = {}
    done: dict[int, Any] = {}
    steps = drafting = stream_steps = 0
    plain_ms = drafting_ms = 0.0
    plain_tokens = drafting_tokens = 0
    start, cpu_start = time.perf_counter(), time.process_time()
    while pending or in_flight:
        while pending and len(in_flight) < concurrency:
            index, prompt = pending.pop(0)
            in_flight[engine.add_request(prompt, params)] = index
        stream_steps += len(engine.scheduler.running) + len(engine.scheduler.waiting)
        spec_before = engine.spec.stats() if engine.spec is not None else None
        step_start = time.perf_counter()
        outs = engine.step()
        ms = (time.perf_counter() - step_start) * 1000
        steps += 1
        tokens = sum(len(out.new_token_ids) for out in outs)
        if spec_before is not None and engine.spec.num_drafts > spec_before.num_drafts:
            drafting += 1
            drafting_ms += ms
            drafting_tokens += tokens
        else:
            plain_ms += ms
            plain_tokens += tokens
        for out in outs:
            if out.finished:
                done[in_flight.pop(out.request_id)] = out
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    after = engine.stats().spec_decode
    rates = [(len(o.token_ids) - 1) / max(o.metrics.finished_time - o.metrics.first_token_time, 1e-9)
             for o in done.values() if len(o.token_ids) > 1 and o.metrics.first_token_time and o.metrics.finished_time]
    total = sum(len(o.token_ids) for o in done.values())
    run = CellRun(output_tok_s=total / wall, decode_tok_s=statistics.fmean(rates) if rates else 0.0, wall_s=wall,
                  cpu_tok_s=total / max(cpu, 1e-9), output_tokens=total, decode_steps=steps, drafting_steps=drafting,
                  draft_tokens=after.num_draft_tokens - before.num_draft_tokens,
                  accepted_tokens=after.num_accepted_tokens - before.num_accepted_tokens,
                  plain_steps=steps - drafting, plain_ms=round(plain_ms, 2), plain_tokens=plain_tokens,
                  drafting_ms=round(drafting_ms, 2), drafting_tokens=drafting_tokens, stream_steps=stream_steps)
    return run, [done[i].token_ids for i in sorted(done)]


def counters_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The decoder's counters over a cell: numbers as differences, the per-request lifetimes that ended in it."""
    out: dict[str, Any] = {}
    for key, value in after.items():
        if key == "lifetimes":
            out["per_request"] = [dict(zip(("verified", "accepted", "shadow_checked", "shadow_hits"), x, strict=True))
                                  for x in value[len(before[key]):]] if len(value) < 512 else None
        elif isinstance(value, (int, float)) and key in before:
            out[key] = round(value - before[key], 3)
    return out


def breakdown(rows: list[dict[str, Any]], counters: list[dict[str, Any]], *, believed_plain_ms: float) -> dict[str, Any]:
    """Where the on-path spent its time in a cell, over its rounds (see the module docstring)."""
    def rate(ms: float, tokens: int) -> float | None:
        return round(tokens / ms, 4) if ms > 0 else None

    ons, offs = [row["on"] for row in rows], [row["off"] for row in rows]
    off_ms, off_tokens = sum(x["plain_ms"] for x in offs), sum(x["plain_tokens"] for x in offs)
    plain_ms, plain_tokens = sum(x["plain_ms"] for x in ons), sum(x["plain_tokens"] for x in ons)
    draft_ms, draft_tokens = sum(x["drafting_ms"] for x in ons), sum(x["drafting_tokens"] for x in ons)
    off_rate = rate(off_ms, off_tokens)
    summed: dict[str, Any] = {}
    for c in counters:
        for key, value in c.items():
            if key == "per_request":
                summed.setdefault(key, []).extend(value or [])
            else:
                summed[key] = round(summed.get(key, 0) + value, 3)
    steps = max(summed.get("steps", 0), 1)
    return {
        "off_tokens_per_ms": off_rate,
        "on_plain_steps": {"steps": sum(x["plain_steps"] for x in ons), "tokens_per_ms": rate(plain_ms, plain_tokens),
                           "vs_off": round(plain_ms and plain_tokens / plain_ms / off_rate, 3) if off_rate else None,
                           "share_of_time": round(plain_ms / max(plain_ms + draft_ms, 1e-9), 3)},
        "on_drafting_steps": {"steps": sum(x["drafting_steps"] for x in ons), "tokens_per_ms": rate(draft_ms, draft_tokens),
                              "vs_off": round(draft_tokens / draft_ms / off_rate, 3) if off_rate and draft_ms else None,
                              "share_of_time": round(draft_ms / max(plain_ms + draft_ms, 1e-9), 3)},
        "propose_ms_per_step": round(summed.get("propose_ms", 0.0) / steps, 4),
        "settle_ms_per_drafting_step": round(summed.get("settle_ms", 0.0) / max(summed.get("drafting_steps", 0), 1), 4),
        "decoder": {k: v for k, v in summed.items() if k not in ("propose_ms", "settle_ms", "per_request")},
        "per_request": summed.get("per_request", []),
        "plain_step_ms": {"policy_believes": round(believed_plain_ms, 3),
                          "off_engine_median_round": round(statistics.median(x["plain_ms"] / max(x["plain_steps"], 1)
                                                                             for x in offs), 3)},
    }


def spread(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3), "max": round(max(values), 3)}


def summarize(cells: dict[str, dict[str, Any]], counters: dict[str, list[dict[str, Any]]], *, curve: Any) -> None:
    """Each cell's ratios over its rounds so far, their spread and verdict, and its breakdown (in place)."""
    for name, cell in cells.items():
        rows = cell["rounds"]
        ons = [row["on"] for row in rows]
        drafted = sum(x["draft_tokens"] for x in ons)
        cell["output_ratio"] = spread([row["output_ratio"] for row in rows])
        cell["decode_ratio"] = spread([row["decode_ratio"] for row in rows])
        cell["cpu_ratio"] = spread([row["cpu_ratio"] for row in rows])
        cell["pooled_output_ratio"] = round(sum(x["output_tokens"] for x in ons) / sum(x["wall_s"] for x in ons) /
                                            (sum(row["off"]["output_tokens"] for row in rows) /
                                             sum(row["off"]["wall_s"] for row in rows)), 3)
        cell["same_tokens_every_round"] = all(row["same_tokens"] for row in rows)
        cell["acceptance"] = round(sum(x["accepted_tokens"] for x in ons) / drafted, 3) if drafted else None
        cell["mean_batch"] = {side: round(sum(row[side]["stream_steps"] for row in rows) /
                                          sum(row[side]["decode_steps"] for row in rows), 2) for side in ("on", "off")}
        cell["drafting_step_share"] = round(sum(x["drafting_steps"] for x in ons) / sum(x["decode_steps"] for x in ons), 3)
        cell["breakdown"] = breakdown(rows, counters[name], believed_plain_ms=float(curve.row_ms(cell["concurrency"], 0)[0]))
        lo, hi = cell["output_ratio"]["min"], cell["output_ratio"]["max"]
        cell["verdict"] = ("within noise" if lo <= 1.0 <= hi else "gain" if lo > 1.0 else "loss") + \
            ("" if cell["output_ratio"]["median"] >= 0.97 else " (median below 0.97)")


def measure(*, rounds: int, rounds_at_16: int, max_tokens: int, concurrency: list[int], workloads: list[str],
            min_requests: int, skip: list[str], partial: Path | None = None) -> dict[str, Any]:
    """`skip`: cells ("workload:concurrency") left out; `rounds_at_16`: the rounds of cells of 16 streams or
    more; `partial`: where the cells so far are written after each one (a long run cut short keeps what
    it measured)."""
    import torch

    from decodeservice.engine import Engine, EngineConfig, SpeculativeConfig
    from decodeservice.engine.quant import detect_cpu

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    load_before = os.getloadavg()
    off = Engine.from_pretrained("smollm2-135m")
    on = Engine(model=off.model, tokenizer=off.tokenizer, config=EngineConfig(speculative=SpeculativeConfig(method="ngram")))
    assert on.spec is not None and on.spec.curve is not None
    spec_cfg = on.spec.config
    texts = {w: [off.tokenizer.apply_chat_template(c) for c in conversations(w)] for w in workloads}
    warm = texts[workloads[0]][0]
    for engine in (off, on):  # the first forwards of a process pay for kernel selection and allocator growth
        run_cell(engine, [warm] * 2, concurrency=2, max_tokens=16)
    cells: dict[str, dict[str, Any]] = {}
    counters: dict[str, list[dict[str, Any]]] = {}
    started = time.perf_counter()
    grid = [(w, c) for w in workloads for c in concurrency if f"{w}:{c}" not in skip]
    used: dict[str, int] = {}  # prompts of each workload handed out so far
    for r in range(rounds):
        for index, (workload, c) in enumerate(grid):
            if c >= 16 and r >= rounds_at_16:
                continue
            count = max(c, min_requests)
            pool = texts[workload]
            # The next prompts of the workload: a prompt an earlier cell sent would be a prefix-cache hit.
            first = used.get(workload, 0)
            used[workload] = first + count
            prompts = [pool[(first + i) % len(pool)] for i in range(count)]
            # Alternating from cell to cell and from round to round: each cell runs each order as often.
            order = [("off", off), ("on", on)] if (index + r) % 2 == 0 else [("on", on), ("off", off)]
            before = on.spec.diagnostics()
            results = {name: run_cell(engine, prompts, concurrency=c, max_tokens=max_tokens) for name, engine in order}
            counters.setdefault(f"{workload} c={c}", []).append(counters_delta(before, on.spec.diagnostics()))
            runs = {name: result[0] for name, result in results.items()}
            cell = cells.setdefault(f"{workload} c={c}", {"workload": workload, "concurrency": c,
                                                          "requests_per_round": count, "rounds": []})
            cell["rounds"].append({
                "first": order[0][0], "load_average": round(os.getloadavg()[0], 2),
                "off": asdict(runs["off"]), "on": asdict(runs["on"]),
                "output_ratio": round(runs["on"].output_tok_s / runs["off"].output_tok_s, 3),
                "decode_ratio": round(runs["on"].decode_tok_s / max(runs["off"].decode_tok_s, 1e-9), 3),
                "cpu_ratio": round(runs["on"].cpu_tok_s / runs["off"].cpu_tok_s, 3),
                "same_tokens": results["on"][1] == results["off"][1]})
            print(f"round {r} {workload} c={c}: on/off {cell['rounds'][-1]['output_ratio']}", file=sys.stderr, flush=True)
            if partial is not None:  # summed up as far as it went
                summarize(cells, counters, curve=on.spec.curve)
                partial.write_text(json.dumps({"load_average": os.getloadavg(), "step_cost_curve": on.spec.curve.describe(),
                                               "step_clock": on.spec.clock.describe(), "cells": cells}, indent=1) + "\n")
    summarize(cells, counters, curve=on.spec.curve)
    return {
        "cpu": detect_cpu().describe(),
        "caps": caps_in_effect(),
        "activations": str(off.dtype).removeprefix("torch."), "kv_cache": str(off.kv_dtype).removeprefix("torch."),
        "weights": off.model.weight_format, "threads": torch.get_num_threads(),
        "speculative": {"method": spec_cfg.method, "num_tokens": spec_cfg.num_tokens,
                        "disable_batch_size": spec_cfg.disable_batch_size, "row_cost_measured": round(on.spec.row_cost, 4),
                        "step_cost_curve": on.spec.curve.describe(),
                        "break_even_acceptance": {str(b): round(v, 3) for b in concurrency
                                                  if (v := on.spec.break_even_acceptance(b)) is not None},
                        "overhead_ms_per_drafting_stream": round(on.spec.overhead_ms, 3),
                        # what the engine's steps took against the curve, per batch size, at the end
                        "step_clock": on.spec.clock.describe()},
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "seconds": round(time.perf_counter() - started, 1),
        "cells": cells,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dispatch", default="native,avx2", help="native, avx2 or both (comma-separated)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--rounds-at-16", type=int, default=2, help="rounds of the cells of 16 streams or more")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--min-requests", type=int, default=4, help="requests per cell and round, at least")
    parser.add_argument("--skip", default="", help="cells to leave out, e.g. mixed:16 (comma-separated)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/spec_on_off.json")
    args = parser.parse_args()
    run = {"rounds": args.rounds, "rounds_at_16": args.rounds_at_16, "max_tokens": args.max_tokens,
           "min_requests": args.min_requests, "concurrency": [int(c) for c in args.concurrency.split(",")],
           "workloads": args.workloads.split(","), "skip": [x for x in args.skip.split(",") if x]}
    if args.child:
        partial = args.out.with_suffix(f".{'avx2' if 'ATEN_CPU_CAPABILITY' in os.environ else 'native'}.partial.json")
        report(measure(**run, partial=partial))
        return
    results: dict[str, Any] = {"command": " ".join(["benchmarks/spec_on_off.py", *sys.argv[1:]]), **run,
                               "size": f"{args.max_tokens} tokens per request, {args.rounds} rounds "
                                       f"({args.rounds_at_16} at 16 streams or more)",
                               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    for dispatch in args.dispatch.split(","):
        results[dispatch] = run_child(__file__, dispatch, sys.argv[1:], cwd=ROOT)
        for name, cell in results[dispatch]["cells"].items():
            print(f"{dispatch} {name}: on/off {cell['output_ratio']} cpu {cell['cpu_ratio']} acceptance "
                  f"{cell['acceptance']} drafting {cell['drafting_step_share']} {cell['verdict']}", flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")  # after each dispatch: a crash keeps the first
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
