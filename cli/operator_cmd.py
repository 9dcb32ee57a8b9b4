"""`decodectl operator`: run the DecodeService operator (kopf, in-process)."""

from __future__ import annotations

import argparse
from typing import Any

from decodeservice.cli.common import add_seconds_option, subcommand_kwargs
from decodeservice.cli.main import UsageError


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "operator", help="reconcile DecodeServices into engine + proxy pods",
        description="Run the DecodeService operator against the cluster in the kubeconfig or service account.",
        **subcommand_kwargs())
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("--namespace", "-n", action="append", default=[], metavar="NS",
                       help="watch this namespace (repeatable; globs like 'team-*' work)")
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace (default)")
    parser.add_argument("--liveness", metavar="URL", default=None,
                        help="serve kopf's liveness probe, e.g. http://0.0.0.0:8080/healthz")
    parser.add_argument("--image", default=None, help="image of the proxy, the init container and CPU engines "
                        "(CPU torch; default: built-in)")
    parser.add_argument("--cuda-image", default=None, help="image of builtin engines with resources.gpus > 0 "
                        "(CUDA torch; default: built-in)")
    parser.add_argument("--vllm-image", default=None, help="default image for engine.kind=vllm")
    add_seconds_option(parser, "--resync-seconds", default=60.0, help="drift repair interval")
    add_seconds_option(parser, "--drain-seconds", default=10, type=int, help="pods' preStop drain")
    add_seconds_option(parser, "--autoscale-interval-seconds", default=5.0, deprecated=("--autoscale-interval",),
                       help="builtin autoscaler's tick when a DecodeService sets no intervalSeconds")
    parser.add_argument("--verbose", action="store_true", help="debug logging")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import kopf

    from decodeservice.operator.autoscaler.controller import AutoscalingConfig
    from decodeservice.operator.handlers import OperatorConfig, build_registry
    from decodeservice.operator.manifests import BuildOptions

    build_kwargs: dict[str, Any] = {"drain_seconds": args.drain_seconds}
    if args.image:
        build_kwargs["image"] = args.image
    if args.cuda_image:
        build_kwargs["cuda_image"] = args.cuda_image
    if args.vllm_image:
        build_kwargs["vllm_image"] = args.vllm_image
    try:
        config = OperatorConfig(build=BuildOptions(**build_kwargs), resync_seconds=args.resync_seconds,
                                autoscaling=AutoscalingConfig(interval_seconds=args.autoscale_interval_seconds))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.liveness is not None and not args.liveness.startswith(("http://", "https://")):
        raise UsageError(f"--liveness must be an http(s) URL, got {args.liveness!r}")
    kopf.configure(verbose=args.verbose)
    # Standalone: one operator replica (the chart runs exactly one), so no kopf peering objects are needed.
    kopf.run(registry=build_registry(config), standalone=True, clusterwide=not args.namespace,
             namespaces=args.namespace, liveness_endpoint=args.liveness)
    return 0
