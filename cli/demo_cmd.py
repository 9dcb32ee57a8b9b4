"""`decodectl demo`: engine + proxy on the bundled model, a `mixed` workload with speculation off and on.

It pulls the model if needed, starts an engine without speculation and one with it, each behind a proxy
on free local ports, sends the same fresh requests to both in interleaved rounds, prints a side-by-side
table with the verdict (the median round's on/off ratio and the rounds' spread) and why speculation
drafted as much as it did, and writes report.json, report.md and report.png (and the servers' logs
under logs/). Where Debian's `prometheus` is installed it also runs one of its own on both proxies and
draws the dashboard's panels to dashboard.png, speculation off and on side by side (docs/monitoring.md).
Ctrl-C stops everything it started.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from decodeservice.cli.common import subcommand_kwargs


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "demo", help="run the engine and the proxy locally and compare speculative decoding off vs on",
        description=__doc__, **subcommand_kwargs(),
    )
    parser.add_argument("--out", type=Path, default=Path("demo-results"), help="report folder (default ./demo-results)")
    parser.add_argument("--num-requests", type=int, help="requests per round, for each of off and on (default 8; "
                        "--quick: 4)")
    parser.add_argument("--rounds", type=int, help="rounds of off and on, in alternating order (default 6; --quick: 2)")
    parser.add_argument("--max-tokens", type=int, help="cap on each request's output length (default 48; --quick: 24)")
    parser.add_argument("--quick", action="store_true", help="a smaller workload, for a first look or CI")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import signal
    from dataclasses import replace
    from types import FrameType

    from rich.console import Console

    from decodeservice.cli.common import UsageError
    from decodeservice.loadgen.demo import Demo, DemoConfig, side_by_side
    from decodeservice.loadgen.errors import BenchConfigError, BenchError

    for flag in ("num_requests", "rounds", "max_tokens"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1")
    config = DemoConfig.quick(args.out) if args.quick else DemoConfig(out=args.out)
    overrides = {k: v for k, v in (("num_requests", args.num_requests), ("rounds", args.rounds),
                                   ("max_tokens", args.max_tokens)) if v}
    try:
        config = replace(config, **overrides)
    except BenchConfigError as exc:
        raise UsageError(str(exc)) from None

    def on_sigterm(_signum: int, _frame: FrameType | None) -> None:
        raise KeyboardInterrupt  # same clean path as Ctrl-C: `finally` stops the children

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    console = Console(stderr=True)
    demo = Demo(config=config, console=console)
    try:
        result, paths = demo.run()
    except BenchError as exc:  # a child that died or never got ready (DemoError), an unusable server
        console.print(f"[bold red]demo failed:[/] {exc}")
        return 1
    except KeyboardInterrupt:
        console.print("interrupted; stopping the servers")
        return 130
    finally:
        demo.close()
        signal.signal(signal.SIGTERM, previous)
    stdout = Console()
    # Piped output (CI, `| tee`) has no terminal width; the default 80 columns would wrap every cell.
    out = stdout if stdout.is_terminal else Console(width=160)
    out.print(side_by_side(result))
    for note in result.notes[:2]:  # the verdict, and why speculation drafted as much as it did
        out.print(note)
    console.print("wrote " + ", ".join(str(p) for p in paths))
    return 0
