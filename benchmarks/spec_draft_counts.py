"""Speculative drafting counts at concurrency 1: deterministic evidence for changes to the k policy.

Wall-clock speed-ups on a shared 2-core machine move by 20-30 % between back-to-back runs of the same
code, which hides a policy change worth a few percent. At concurrency 1 with greedy requests, what the
policy does is deterministic: how many decode steps verified how many drafts. This benchmark counts
that per workload (each on a fresh engine, plus all workloads in turn on one engine) and turns it into
a modeled speed-up with the median step time by drafts verified that `spec_decode.py` measured
(`--step-times`, default `benchmarks/results/spec_decode_cpu2.json`):

    modeled speed-up = decode tokens x step_ms[0] / sum over decode steps of step_ms[drafts verified]

    .venv/bin/python -P benchmarks/spec_draft_counts.py --max-tokens 48 --output counts.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))  # `python -P` leaves the script's folder off the path
from spec_decode import WORKLOADS, workload_messages


def step_costs(path: Path) -> dict[int, float]:
    """Median step ms by drafts verified, averaged over the workloads' concurrency-1 'on' rows."""
    samples: dict[int, list[float]] = {}
    for rows in json.loads(path.read_text())["workloads"].values():
        for drafts, ms in rows[0]["on"]["median_step_ms_by_drafts"].items():
            samples.setdefault(int(drafts), []).append(ms)
    return {k: sum(v) / len(v) for k, v in sorted(samples.items())}


def count(engine: Any, prompts: list[str], max_tokens: int) -> tuple[int, dict[int, int]]:
    """Decode tokens, and decode steps by drafts verified, for prompts sent one after another."""
    from decodeservice.engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    steps: dict[int, int] = {}
    tokens = 0
    for prompt in prompts:
        engine.add_request(prompt, params)
        prefill = True
        while engine.has_unfinished_requests():
            before = engine.stats().spec_decode.num_draft_tokens
            outputs = engine.step()
            if not prefill:  # the first step prefills and samples the first token
                drafts = engine.stats().spec_decode.num_draft_tokens - before
                steps[drafts] = steps.get(drafts, 0) + 1
            prefill = False
            tokens += sum(len(o.token_ids) - 1 for o in outputs if o.finished)
    return tokens, steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--num-tokens", type=int, default=8, help="most drafts per step (k)")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--step-times", type=Path, default=Path(__file__).parent / "results" / "spec_decode_cpu2.json")
    parser.add_argument("--output", default="-", help="JSON file, or - for stdout")
    args = parser.parse_args(argv)

    import torch

    from decodeservice.engine import Engine, EngineConfig, SpeculativeConfig

    torch.set_num_threads(args.threads)
    costs = step_costs(args.step_times)
    base = Engine.from_pretrained(args.model)
    config = EngineConfig(speculative=SpeculativeConfig(method="ngram", num_tokens=args.num_tokens))
    report: dict[str, Any] = {"model": args.model, "num_tokens": args.num_tokens, "max_tokens": args.max_tokens,
                              "step_ms_by_drafts": costs, "workloads": {}}
    runs = [[name] for name in WORKLOADS] + [list(WORKLOADS)]
    for names in runs:
        engine = Engine(model=base.model, tokenizer=base.tokenizer, config=config)
        prompts = [base.tokenizer.apply_chat_template([{"role": "user", "content": m}])
                   for name in names for m in workload_messages(name)]
        tokens, steps = count(engine, prompts, args.max_tokens)
        spec = engine.stats().spec_decode
        modeled_ms = sum(costs[k] * n for k, n in steps.items())
        label = names[0] if len(names) == 1 else "all_in_turn"
        report["workloads"][label] = {
            "decode_tokens": tokens, "decode_steps": sum(steps.values()), "verifies": spec.num_drafts,
            "draft_tokens": spec.num_draft_tokens, "accepted_tokens": spec.num_accepted_tokens,
            "steps_by_drafts": dict(sorted(steps.items())),
            "modeled_speedup": round(tokens * costs[0] / modeled_ms, 3),
        }
        print(label, report["workloads"][label], file=sys.stderr)
    text = json.dumps(report, indent=2)
    if args.output == "-":
        print(text)
    else:
        Path(args.output).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
