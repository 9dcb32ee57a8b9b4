"""`decodectl bench`: benchmark any OpenAI-compatible server through streaming requests.

Examples:

    decodectl bench --url http://127.0.0.1:8000 --dataset chat --concurrency 1,4,16 --num-requests 50
    decodectl bench --url http://127.0.0.1:8000 --dataset mixed --rate 2 --seed 7 --max-tokens dataset \\
        --slo ttft=1000,itl=100

Metric definitions (TTFT, TPOT, ITL, e2e, goodput) are those of `vllm bench serve`; see
`decodeservice.loadgen.metrics` and the generated report.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from decodeservice.cli.common import subcommand_kwargs

MAX_TOKENS_HELP = (
    "tokens per request: N (fixed), uniform:LO:HI (seeded), dataset (each entry's output_len) or "
    "dataset:CAP (output_len capped at CAP); default 256"
)


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "bench", help="benchmark an OpenAI-compatible server (TTFT, TPOT, ITL, throughput, goodput)",
        description=__doc__, **subcommand_kwargs(),
    )
    parser.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", help="model name to request (default: the first of GET /v1/models)")
    parser.add_argument("--dataset", default="chat", help="chat, summarize, mixed, or a JSONL file (default chat)")
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--concurrency", help="comma-separated concurrency sweep, e.g. 1,4,16 (default 1)")
    load.add_argument("--rate", help="Poisson arrival rate in requests/s (open loop; see --seed)")
    parser.add_argument("--num-requests", type=int, default=100, help="requests per load level (default 100)")
    parser.add_argument("--max-tokens", default="256", help=MAX_TOKENS_HELP)
    parser.add_argument("--slo", help="per-request SLO for goodput, ms: ttft=MS,itl=MS,tpot=MS,e2e=MS (any subset)")
    parser.add_argument("--seed", type=int, default=0, help="seed for prompt sampling, lengths and arrivals")
    parser.add_argument("--out", type=Path, default=Path("bench-results"),
                        help="folder for report.json, report.md and report.png (default ./bench-results)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import asyncio

    from rich.console import Console

    from decodeservice.cli.common import UsageError
    from decodeservice.loadgen import report
    from decodeservice.loadgen.dataset import MaxTokens
    from decodeservice.loadgen.errors import BenchError
    from decodeservice.loadgen.load import LoadLevel, parse_concurrency
    from decodeservice.loadgen.metrics import Slo
    from decodeservice.loadgen.runner import BenchConfig, run_benchmark

    try:
        if args.rate is not None:
            try:
                rate = float(args.rate)
            except ValueError:
                raise UsageError(f"--rate {args.rate!r} is not a number") from None
            levels: tuple[LoadLevel, ...] = (LoadLevel(kind="rate", value=rate),)
        else:
            levels = parse_concurrency(args.concurrency or "1")
        config = BenchConfig(
            url=args.url, model=args.model, dataset=args.dataset, levels=levels, num_requests=args.num_requests,
            max_tokens=MaxTokens.parse(args.max_tokens), slo=Slo.parse(args.slo) if args.slo else None,
            seed=args.seed,
        )
        stderr = Console(stderr=True)
        result = asyncio.run(run_benchmark(config, console=stderr))
    except BenchError as exc:
        # Bad options, bad dataset files and unreachable servers are all the user's to fix: exit code 2.
        raise UsageError(str(exc)) from None
    stdout = Console()
    # Piped output (CI, `| tee`) has no terminal width; the default 80 columns would wrap every cell.
    (stdout if stdout.is_terminal else Console(width=200)).print(report.table(result))
    paths = report.write(result, args.out)
    stderr.print("wrote " + ", ".join(str(p) for p in paths))
    return 0 if all(level.completed for level in result.levels) else 1
