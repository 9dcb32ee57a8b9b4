"""`decodectl router`: the fleet router in front of a service's pods (docs/routing.md)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from decodeservice.cli.common import add_seconds_option, subcommand_kwargs


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "router", help="route requests across a service's pods (prefix affinity, load, SLO; holds at zero pods)",
        description="Run the DecodeService fleet router: an OpenAI-compatible front that picks a pod's proxy "
        "per request by prefix-cache affinity, load and the TTFT objective, sheds at the edge, and holds "
        "requests while no pod is ready (scale from zero).",
        **subcommand_kwargs(),
    )
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--endpoints", metavar="URL[,URL...]",
                       help="a static list of the pods' proxy URLs (local runs); readiness probed on /ready")
    where.add_argument("--service", metavar="NAME",
                       help="watch the EndpointSlices labelled kubernetes.io/service-name=NAME (in-cluster)")
    parser.add_argument("--namespace", default=None, help="the Service's namespace (default: the router pod's own)")
    parser.add_argument("--endpoint-port", type=int, default=8000, help="the pods' proxy port (with --service)")
    parser.add_argument("--policy", type=Path, help="the proxy's policy.yaml (classes, slo.ttftMs, "
                        "isolatePrefixCache); default: every policy at its default")
    add_seconds_option(parser, "--hold-seconds", default=30.0,
                       help="how long a request waits for a ready endpoint before a 503")
    parser.add_argument("--max-held", type=int, default=256, help="requests held at once; more get a 503")
    parser.add_argument("--block-size", type=int, default=16, help="the engines' KV block size, in tokens")
    add_seconds_option(parser, "--scrape-interval-seconds", default=1.0,
                       help="how often each endpoint's /ready and /metrics are read")
    add_seconds_option(parser, "--drain-timeout-seconds", default=30.0,
                       help="how long SIGTERM waits for in-flight requests")
    parser.set_defaults(func=run)


NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def _endpoint_urls(value: str) -> tuple[str, ...]:
    from decodeservice.cli.main import UsageError

    urls = tuple(u.strip().rstrip("/") for u in value.split(",") if u.strip())
    if not urls:
        raise UsageError("--endpoints needs at least one URL")
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise UsageError(f"--endpoints: {url!r} is not an http(s) URL")
    if len(set(urls)) != len(urls):
        raise UsageError("--endpoints lists a URL twice")
    return urls


def run(args: argparse.Namespace) -> int:
    from decodeservice.cli.main import UsageError
    from decodeservice.proxy.policy import Policy, PolicyError
    from decodeservice.router.config import RouterConfig, RouterConfigError
    from decodeservice.router.endpoints import EndpointSliceWatch, EndpointSource, StaticEndpoints

    for flag, port in (("--port", args.port), ("--endpoint-port", args.endpoint_port)):
        if not 0 < port < 65536:
            raise UsageError(f"{flag} must be in 1..65535, got {port}")
    try:
        policy = Policy.from_yaml_file(args.policy) if args.policy else Policy()
    except PolicyError as exc:
        raise UsageError(str(exc)) from None
    try:
        config = RouterConfig(policy=policy, hold_seconds=args.hold_seconds, max_held=args.max_held,
                              block_size=args.block_size, scrape_interval_s=args.scrape_interval_seconds)
    except RouterConfigError as exc:
        raise UsageError(str(exc)) from None
    source: EndpointSource
    if args.endpoints is not None:
        source = StaticEndpoints(urls=_endpoint_urls(args.endpoints))
    else:
        namespace = args.namespace
        if namespace is None:
            try:
                namespace = NAMESPACE_FILE.read_text().strip()
            except OSError:
                raise UsageError("--namespace is needed outside a pod") from None
        source = EndpointSliceWatch(service=args.service, namespace=namespace, port=args.endpoint_port)
        try:
            EndpointSliceWatch.check_config()
        except Exception as exc:  # the client's ConfigException: no service account token, no API address
            raise UsageError(f"--service watches EndpointSlices from inside a pod, and this is not one: {exc}") from None

    from decodeservice.common.lifecycle import Lifecycle, Phase
    from decodeservice.proxy.serve import serve
    from decodeservice.router.app import create_app

    lifecycle = Lifecycle(phase=Phase.READY)
    app = create_app(config, source, lifecycle=lifecycle)
    serve(app, lifecycle=lifecycle, host=args.host, port=args.port, drain_timeout=args.drain_timeout_seconds,
          log_level=args.log_level)
    return 0
