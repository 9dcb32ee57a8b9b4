"""`decodectl bench`."""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser("bench", help="(not yet available)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from decodeservice.cli.main import UsageError

    raise UsageError("not implemented yet")
