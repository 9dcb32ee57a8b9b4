"""`decodectl render -f ds.yaml [-o yaml|json]`: print what the operator would create, with no cluster.

YAML is multi-document, with no anchors or aliases (each object is written out in full, as
`kubectl get -o yaml` does); JSON is one `v1 List`, which `kubectl apply -f -` takes as it is.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from decodeservice.cli.common import UsageError, subcommand_kwargs

OUTPUTS = ("yaml", "json")


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "render", help="print the Kubernetes objects a DecodeService becomes",
        description="Render a DecodeService manifest into the Deployment, Service, ConfigMap and PDB (and, "
                    "with routing mode router, the router's Deployment, PDB, RBAC and NAME-pods Service) the "
                    "operator would create. No cluster is needed; the spec is validated as the operator "
                    "validates it (exit 2 with the field named).",
        **subcommand_kwargs())
    parser.add_argument("-f", "--filename", required=True, help="DecodeService manifest ('-' for stdin)")
    parser.add_argument("-o", "--output", default="yaml", choices=OUTPUTS, type=str.lower,
                        help="yaml: multi-document YAML without anchors; json: one v1 List")
    parser.add_argument("--namespace", "-n", default="default", help="namespace when the manifest has none")
    parser.add_argument("--image", default=None,
                        help="image of the engine/proxy containers (default: the operator's built-in image)")
    parser.add_argument("--cuda-image", default=None,
                        help="image of builtin engines with resources.gpus > 0 (default: the operator's)")
    parser.add_argument("--vllm-image", default=None,
                        help="image for engine.kind=vllm without engine.image (default: the operator's)")
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
    if args.cuda_image:
        options["cuda_image"] = args.cuda_image
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
    sys.stdout.write(dump(objects, output=args.output))
    return 0


def dump(objects: list[dict[str, Any]], *, output: str) -> str:
    """The objects as `output`: YAML documents written out in full, or a JSON v1 List."""
    import json

    import yaml

    if output == "json":
        return json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}, indent=2) + "\n"

    class NoAliases(yaml.SafeDumper):
        # PyYAML writes &id001 / *id001 for a dict or list that appears twice (a label map shared by the
        # selector and the template); kubectl and most readers cope, humans and diff tools do not.
        def ignore_aliases(self, data: Any) -> bool:
            return True

    return yaml.dump_all(objects, Dumper=NoAliases, sort_keys=False)
