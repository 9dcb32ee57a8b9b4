"""`decodectl render -f ds.yaml`: print what the operator would create, with no cluster."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from decodeservice.cli.main import UsageError


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "render", help="print the Kubernetes objects a DecodeService becomes",
        description="Render a DecodeService manifest into the Deployment, Service, ConfigMap and PDB the "
                    "operator would create, as multi-document YAML. No cluster is needed.")
    parser.add_argument("-f", "--filename", required=True, help="DecodeService manifest ('-' for stdin)")
    parser.add_argument("--namespace", "-n", default="default", help="namespace when the manifest has none")
    parser.add_argument("--image", default=None, help="image of the engine/proxy containers")
    parser.add_argument("--vllm-image", default=None, help="default image for engine.kind=vllm")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import yaml

    from decodeservice.operator.errors import InvalidSpecError
    from decodeservice.operator.manifests import BuildOptions, render

    try:
        # read_text closes the file (a bare open().read() leaks the handle until GC, a ResourceWarning).
        text = sys.stdin.read() if args.filename == "-" else Path(args.filename).read_text(encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"cannot read {args.filename}: {exc.strerror}") from None
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise UsageError(f"{args.filename}: not valid YAML: {exc}") from None
    if not docs:
        raise UsageError(f"{args.filename}: no DecodeService in the file")
    options: dict[str, Any] = {}
    if args.image:
        options["image"] = args.image
    if args.vllm_image:
        options["vllm_image"] = args.vllm_image
    objects: list[dict[str, Any]] = []
    for doc in docs:
        if not isinstance(doc, dict):
            raise UsageError(f"{args.filename}: each document must be a mapping")
        try:
            objects += render(doc, options=BuildOptions(**options), default_namespace=args.namespace).all()
        except (InvalidSpecError, ValueError) as exc:
            raise UsageError(f"{args.filename}: {exc}") from None
    sys.stdout.write(yaml.safe_dump_all(objects, sort_keys=False))
    return 0
