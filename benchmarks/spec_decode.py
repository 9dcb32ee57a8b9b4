"""Speculative decoding benchmark: decode tokens/s with speculation off and on, acceptance, and a
concurrency sweep, on workloads made here (deterministic, shipped in code):

- input_grounded: chat-formatted "correct this paragraph and return the full paragraph" and "rename
  this variable / add a docstring and return the full code" requests, whose answers copy long spans
  of the prompt;
- dense_edits: "fix the spelling" of short texts with a typo every few words, and docstrings; the
  answers break away from the input often (on the bundled model the docstring answers rewrite the code);
- open_ended: chat questions, whose answers copy little.

Variants: off; on (the default adaptive k, as the server runs it); on_always (k drafts every step at
any batch size, the raw gain or loss). Decode tokens/s excludes time to first token: per request it is
(tokens - 1) / (finish - first token). Requests are greedy, so the benchmark also checks that outputs
are identical in every variant.

    .venv/bin/python -P benchmarks/spec_decode.py --output spec_decode.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

# Input-grounded: "return the full text" edits of whole paragraphs and functions with a mistake or two,
# the way editing requests usually look. On the bundled model the answer copies most of the input.
PARAGRAPH_EDITS = [
    ("spelling", "The city library opened a new reading room last month. It has large windows, comfortable "
     "chairs and a quiet corner for children. Many people come every morning to read the newspapers and "
     "borrow books. The librarians say that the number of visitors has doubled since the room opened, and "
     "they plan to add more shelfs next year."),
    ("grammar", "The project was finished on time and the team was very happy with the result. Everyone "
     "worked hard during the last weeks, and the manager thanked them in a short speech. The new system is "
     "faster than the old one and it use less memory. Customers have already noticed the difference, and "
     "several of them sent messages to say how much they like it."),
    ("grammar", "We left the house early in the morning. The sky was grey and a cold wind were blowing from "
     "the north. After an hour we reached the old bridge and stopped for coffee. By noon the clouds had "
     "cleared and the sun was shining over the hills. In the afternoon we visited the castle and the "
     "museum, and in the evening we took the bus home."),
    ("grammar", "Learning a new language takes time and patience. You should practice every day, read "
     "books, and listens to native speakers. Over time you will notice that your vocabulary grows and "
     "your grammar improves. Do not be afraid of making mistakes, because every mistake is a chance to "
     "learn something new."),
    ("grammar", "Our team meeting will take place on Tuesday at ten o'clock. Please bring your reports and "
     "be ready to discuss the progress of each project. We will also talks about the budget for the next "
     "quarter and the plans for the summer. If you cannot attend, send your report to the team leader "
     "before the meeting."),
]
MOVING_AVERAGE = (
    "def moving_average(values, window):\n    result = []\n    total = 0.0\n    for i, value in enumerate(values):\n"
    "        total += value\n        if i >= window:\n            total -= values[i - window]\n"
    "        if i >= window - 1:\n            result.append(total / window)\n    return result\n")
MERGE_SORTED = (
    "def merge_sorted(left, right):\n    merged = []\n    i = j = 0\n    while i < len(left) and j < len(right):\n"
    "        if left[i] <= right[j]:\n            merged.append(left[i])\n            i += 1\n        else:\n"
    "            merged.append(right[j])\n            j += 1\n    merged.extend(left[i:])\n"
    "    merged.extend(right[j:])\n    return merged\n")
CODE_EDITS = [
    ("Rename the variable `merged` to `result` in this Python function", MERGE_SORTED),
    ("Rename the variable `total` to `running_sum` in this Python function", MOVING_AVERAGE),
    ("Add a docstring to this Python function. Return the complete function, unchanged except for the "
     "docstring", MOVING_AVERAGE),
]
# Dense edits (the first version of the input-grounded set): a typo every few words, so the answer
# breaks off from the input often; on the bundled model the docstring requests rewrite the code.
TYPO_TEXTS = [
    "The quick brown fox jumpd over the lazy dog. It was a sunny day and the animls in the forrest were "
    "enjoying the warm wether. Birds were singing in the tres and a small river was runing nearby.",
    "Our team meting will take place on Tuesday at ten oclock. Please bring your reports and be redy to "
    "discuss the progres of each project. We will also talk about the budjet for the next quarter.",
    "Learning a new langauge takes time and paitence. Practice every day, read books, and listen to "
    "native speekers. Over time you will notice that your vocabulary grows and your grammer improves.",
]
CHAT_QUESTIONS = [
    "What are some good habits for staying healthy while working from home?",
    "Tell me a short story about a robot who wants to become a painter.",
    "Why is the sky blue? Explain it to a ten year old.",
    "Give me three ideas for a weekend trip with friends.",
]
WORKLOADS = ("input_grounded", "dense_edits", "open_ended")


def workload_messages(name: str) -> list[str]:
    """User messages of a workload, in a fixed order."""
    if name == "input_grounded":
        paragraphs = [f"Correct the {kind} in this paragraph and return the full paragraph:\n\n{text}"
                      for kind, text in PARAGRAPH_EDITS]
        code = [f"{task} and return the full code:\n\n```python\n{source}```" for task, source in CODE_EDITS]
        # Interleaved, so a short run (--requests 2) still sees both kinds.
        interleaved = [m for pair in zip(paragraphs, code, strict=False) for m in pair]
        return interleaved + paragraphs[len(code):]
    if name == "dense_edits":
        spelling = [f"Fix the spelling mistakes in this text and return the whole corrected text:\n\n{t}"
                    for t in TYPO_TEXTS]
        docstring = [f"Add a docstring to this Python function and return the full code:\n\n```python\n{c}```"
                     for c in (MOVING_AVERAGE, MERGE_SORTED, MOVING_AVERAGE)]
        return [m for pair in zip(spelling, docstring, strict=True) for m in pair]
    if name == "open_ended":
        return list(CHAT_QUESTIONS)
    raise ValueError(f"unknown workload {name!r}")


@dataclass(frozen=True, kw_only=True)
class RunResult:
    decode_tok_s: float  # mean over requests of (tokens - 1) / decode time
    aggregate_decode_tok_s: float  # all decode tokens / wall time
    # all decode tokens / CPU seconds of this process (prefill included): steadier than wall time on
    # a shared machine, since other processes' load does not count.
    cpu_decode_tok_s: float
    mean_acceptance_length: float | None  # tokens per verification step (accepted + 1)
    num_requests: int
    output_tokens: int
    outputs: list[list[int]]
    # Median wall time of a decode-only step by the draft tokens it verified (0: a plain decode step);
    # measured at concurrency 1 only, where a step holds one sequence.
    step_ms_by_drafts: dict[int, float]


def run(engine: Any, prompts: list[str], *, concurrency: int, max_tokens: int) -> RunResult:
    """Closed loop: keep `concurrency` requests in flight until every prompt is done."""
    from decodeservice.engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    before = engine.stats().spec_decode
    pending = list(enumerate(prompts))
    in_flight: dict[str, int] = {}
    done: dict[int, Any] = {}
    step_times: dict[int, list[float]] = {}
    start, cpu_start = time.perf_counter(), time.process_time()
    while pending or in_flight:
        admitted = False
        while pending and len(in_flight) < concurrency:
            index, prompt = pending.pop(0)
            in_flight[engine.add_request(prompt, params)] = index
            admitted = True
        drafts_before = engine.stats().spec_decode.num_draft_tokens
        step_start = time.perf_counter()
        outs = engine.step()
        step_time = time.perf_counter() - step_start
        if concurrency == 1 and not admitted:  # a step with a prompt in it is not a decode step
            drafts = engine.stats().spec_decode.num_draft_tokens - drafts_before
            step_times.setdefault(drafts, []).append(step_time)
        for out in outs:
            if out.finished:
                done[in_flight.pop(out.request_id)] = out
    wall = time.perf_counter() - start
    cpu = time.process_time() - cpu_start
    after = engine.stats().spec_decode
    rates, decode_tokens = [], 0
    for out in done.values():
        n = len(out.token_ids) - 1
        m = out.metrics
        if n > 0 and m.first_token_time is not None and m.finished_time is not None:
            rates.append(n / max(m.finished_time - m.first_token_time, 1e-9))
            decode_tokens += n
    drafts = after.num_drafts - before.num_drafts
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    return RunResult(decode_tok_s=sum(rates) / max(len(rates), 1), aggregate_decode_tok_s=decode_tokens / wall,
                     cpu_decode_tok_s=decode_tokens / max(cpu, 1e-9),
                     mean_acceptance_length=1 + accepted / drafts if drafts else None,
                     num_requests=len(done), output_tokens=sum(len(o.token_ids) for o in done.values()),
                     outputs=[done[i].token_ids for i in sorted(done)],
                     step_ms_by_drafts={k: 1000 * statistics.median(v) for k, v in sorted(step_times.items())})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--method", default="ngram", choices=["ngram", "self_draft"])
    parser.add_argument("--num-tokens", type=int, default=8, help="most drafts per step (k)")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--requests", type=int, default=2, help="requests per run at concurrency 1 "
                        "(a run at concurrency c uses max(c, this) requests)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--output", default="-", help="JSON file, or - for stdout")
    args = parser.parse_args(argv)

    import torch

    from decodeservice.engine import Engine, EngineConfig, SpeculativeConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    base = Engine.from_pretrained(args.model)
    # "on" is the product default (k adapts to acceptance and batch size); "on_always" drafts k at every
    # step whatever the batch, to show the raw gain or loss the adaptive rule avoids.
    spec = SpeculativeConfig(method=args.method, num_tokens=args.num_tokens)
    variants: dict[str, EngineConfig] = {
        "off": EngineConfig(),
        "on": EngineConfig(speculative=spec),
        "on_always": EngineConfig(speculative=SpeculativeConfig(method=args.method, num_tokens=args.num_tokens,
                                                                disable_batch_size=10**6, draft_row_cost=0.0)),
    }
    engines = {name: Engine(model=base.model, tokenizer=base.tokenizer, config=cfg) for name, cfg in variants.items()}
    report: dict[str, Any] = {"model": args.model, "method": args.method, "num_tokens": args.num_tokens,
                              "max_tokens": args.max_tokens, "torch_threads": torch.get_num_threads(),
                              "disable_batch_size": spec.disable_batch_size,
                              "draft_row_cost_measured": engines["on"].spec.row_cost if engines["on"].spec else None,
                              "workloads": {}}
    # Warm-up: the first forwards of a process pay for oneDNN kernel selection and allocator growth.
    warm_prompt = base.tokenizer.apply_chat_template([{"role": "user", "content": workload_messages("input_grounded")[0]}])
    for engine in engines.values():
        run(engine, [warm_prompt], concurrency=1, max_tokens=24)
    for workload in args.workloads.split(","):
        messages = workload_messages(workload)
        prompts = [base.tokenizer.apply_chat_template([{"role": "user", "content": m}]) for m in messages]
        sweep = []
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            count = max(concurrency, args.requests)
            batch = [prompts[i % len(prompts)] for i in range(count)]
            row: dict[str, Any] = {"concurrency": concurrency, "num_requests": count}
            results = {}
            for name, engine in engines.items():
                results[name] = run(engine, batch, concurrency=concurrency, max_tokens=args.max_tokens)
                print(f"{workload} c={concurrency} {name}: {results[name].decode_tok_s:.2f} tok/s",
                      file=sys.stderr)
            for name, res in results.items():
                row[name] = {"decode_tok_s": round(res.decode_tok_s, 3),
                             "aggregate_decode_tok_s": round(res.aggregate_decode_tok_s, 3),
                             "cpu_decode_tok_s": round(res.cpu_decode_tok_s, 3),
                             "mean_acceptance_length": None if res.mean_acceptance_length is None
                             else round(res.mean_acceptance_length, 3),
                             "output_tokens": res.output_tokens}
                if res.step_ms_by_drafts:
                    row[name]["median_step_ms_by_drafts"] = {str(k): round(v, 1)
                                                             for k, v in res.step_ms_by_drafts.items()}
            off = results["off"]
            for name in ("on", "on_always"):
                on = results[name]
                suffix = "" if name == "on" else "_always"
                row["speedup" + suffix] = round(on.decode_tok_s / off.decode_tok_s, 3)
                row["aggregate_speedup" + suffix] = round(on.aggregate_decode_tok_s / off.aggregate_decode_tok_s, 3)
                row["cpu_speedup" + suffix] = round(on.cpu_decode_tok_s / off.cpu_decode_tok_s, 3)
            row["identical_outputs"] = all(res.outputs == off.outputs for res in results.values())
            sweep.append(row)
        report["workloads"][workload] = sweep
    text = json.dumps(report, indent=2)
    if args.output == "-":
        print(text)
    else:
        with open(args.output, "w") as fh:
            fh.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
