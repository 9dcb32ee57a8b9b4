"""Entry point of `decodectl`.

Each subcommand lives in its own module with `register(subparsers)`; heavy imports (torch, kopf)
happen inside the handlers so `decodectl --help` stays instant. What the subcommands share (the help
formatter, `--log-level`, duration flags, `UsageError`) is in `cli/common.py`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from decodeservice.cli.common import HelpFormatter, UsageError, configure_logging, ensure_common_options

__all__ = ["SUBCOMMANDS", "UsageError", "build_parser", "main", "version"]

SUBCOMMANDS = ("engine", "proxy", "router", "operator", "bench", "demo", "render", "up", "models", "dashboard")
PARSER_KEY = "_parser"  # each (sub)command parser stores itself here, so errors can print its usage

DESCRIPTION = """\
decodectl: serve LLMs on Kubernetes against a latency SLO (DecodeService).

One command line for every part: run the engine and the policy proxy, run the operator that turns
DecodeService resources into engine + proxy pods, render those resources without a cluster, benchmark
any OpenAI-compatible server, and fetch the bundled models.

  decodectl render -f examples/cpu-smoke.yaml     what a DecodeService becomes, no cluster needed
  decodectl demo --quick                          engine + proxy locally, speculation off vs on
  decodectl COMMAND --help                        every option of COMMAND with its default
"""


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as package_version

    try:
        return package_version("decodeservice")
    except PackageNotFoundError:  # run from a tree that was never installed
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="decodectl", description=DESCRIPTION, formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"decodectl {version()}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMANDS:
        module = importlib.import_module(f"decodeservice.cli.{name}_cmd")
        module.register(subparsers)
    for sub in subparsers.choices.values():
        ensure_common_options(sub)
        if sub.get_default(PARSER_KEY) is None:
            sub.set_defaults(**{PARSER_KEY: sub})
    return parser


def _leaf(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The innermost parser that ran (`models pull`, not `models`), whose usage an error should show."""
    leaf = getattr(args, PARSER_KEY, None)
    return leaf if isinstance(leaf, argparse.ArgumentParser) else parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    # parse_known_args, then the subcommand's own error: argparse would print the top-level usage for
    # an unknown flag of a subcommand, which says nothing about that subcommand's flags.
    args, unknown = parser.parse_known_args(argv)
    leaf = _leaf(parser, args)
    if unknown:
        leaf.error(f"unrecognized arguments: {' '.join(unknown)}")
    configure_logging(getattr(args, "log_level", "info"))
    try:
        code = args.func(args)
    except UsageError as exc:  # a bad value, found by the handler: the message names the flag
        parser.exit(2, f"{leaf.prog}: error: {exc}\n")
    except KeyboardInterrupt:
        return 130
    return int(code or 0)


if __name__ == "__main__":
    # Under `python -m` this file runs as __main__; dispatch through the package module so that
    # UsageError is the same class the subcommands raise.
    from decodeservice.cli.main import main as package_main

    sys.exit(package_main())
