"""Entry point of `decodectl`.

Each subcommand lives in its own module with `register(subparsers)`; heavy imports (torch, kopf)
happen inside the handlers so `decodectl --help` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

SUBCOMMANDS = ("engine", "proxy", "operator", "bench", "demo", "render", "models")


class UsageError(Exception):
    """Bad command-line input: printed as `decodectl: error: ...` with exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="decodectl", description=__doc__.splitlines()[0] if __doc__ else None)
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMANDS:
        module = importlib.import_module(f"decodeservice.cli.{name}_cmd")
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = args.func(args)
    except UsageError as exc:
        parser.exit(2, f"decodectl {args.command}: error: {exc}\n")
    except KeyboardInterrupt:
        return 130
    return int(code or 0)


if __name__ == "__main__":
    # Under `python -m` this file runs as __main__; dispatch through the package module so that
    # UsageError is the same class the subcommands raise.
    from decodeservice.cli.main import main as package_main

    sys.exit(package_main())
