"""`decodectl operator`: run the DecodeService operator (kopf, in-process)."""

from __future__ import annotations

import argparse
import urllib.parse
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
    parser.add_argument("--metrics", metavar="URL", default=None,
                        help="serve each DecodeService's replicas, autoscaler signal and cold start as Prometheus "
                        "metrics, e.g. http://0.0.0.0:8081/metrics")
    parser.add_argument("--image", default=None, help="image of the proxy, the init container and CPU engines "
                        "(CPU torch; default: built-in)")
    parser.add_argument("--cuda-image", default=None, help="image of builtin engines with resources.gpus > 0 "
                        "(CUDA torch; default: built-in)")
    parser.add_argument("--vllm-image", default=None, help="default image for engine.kind=vllm")
    parser.add_argument("--router-image", default=None, help="image of the fleet routers (routing mode router; "
                        "default: --image)")
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
    if args.router_image:
        build_kwargs["router_image"] = args.router_image
    try:
        config = OperatorConfig(build=BuildOptions(**build_kwargs), resync_seconds=args.resync_seconds,
                                autoscaling=AutoscalingConfig(interval_seconds=args.autoscale_interval_seconds))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.liveness is not None and not args.liveness.startswith(("http://", "https://")):
        raise UsageError(f"--liveness must be an http(s) URL, got {args.liveness!r}")
    metrics = _metrics_address(args.metrics) if args.metrics is not None else None
    kopf.configure(verbose=args.verbose)
    registry = build_registry(config)
    if metrics is not None:
        from decodeservice.operator.metrics import install

        install(registry, host=metrics[0], port=metrics[1])
    # Standalone: one operator replica (the chart runs exactly one), so no kopf peering objects are needed.
    kopf.run(registry=registry, standalone=True, clusterwide=not args.namespace,
             namespaces=args.namespace, liveness_endpoint=args.liveness)
    return 0


def _metrics_address(url: str) -> tuple[str, int]:
    parsed = urllib.parse.urlsplit(url)
    try:
        port = parsed.port
    except ValueError:
        port = None
    if parsed.scheme != "http" or not parsed.hostname or port is None or parsed.path not in ("", "/metrics"):
        raise UsageError(f"--metrics must look like http://HOST:PORT/metrics, got {url!r}")
    return parsed.hostname, port
