"""`decodectl proxy`: the SLO-aware sidecar in front of an OpenAI-compatible engine."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from decodeservice.cli.common import add_seconds_option, subcommand_kwargs


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "proxy", help="run the policy proxy in front of an engine",
        description="Run the DecodeService sidecar proxy (Starlette on uvicorn) in front of an engine.",
        **subcommand_kwargs(),
    )
    parser.add_argument("--upstream", required=True, help="engine base URL, e.g. http://127.0.0.1:8001")
    parser.add_argument("--engine-kind", choices=["builtin", "vllm"], default="builtin",
                        help="what the upstream is; picks the path /ready asks it: builtin GET /ready, "
                        "vllm GET /health (vLLM has no /ready)")
    parser.add_argument("--upstream-health-path", default=None, metavar="PATH",
                        help="override the upstream path /ready asks (200 means ready), e.g. /health; "
                        "unset: the engine kind's")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--policy", type=Path, help="policy.yaml (default: every policy at its default)")
    parser.add_argument("--tokenizer", type=Path, help="tokenizer.json for counting prompt tokens locally "
                        "(default: the upstream's POST /tokenize)")
    add_seconds_option(parser, "--drain-timeout-seconds", default=30.0,
                       help="how long SIGTERM waits for in-flight requests", deprecated=("--drain-timeout",))
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from decodeservice.cli.main import UsageError
    from decodeservice.proxy.policy import Policy, PolicyError

    upstream: str = args.upstream
    if not upstream.startswith(("http://", "https://")):
        raise UsageError(f"--upstream must be an http(s) URL, got {upstream!r}")
    if not 0 < args.port < 65536:
        raise UsageError(f"--port must be in 1..65535, got {args.port}")
    try:
        policy = Policy.from_yaml_file(args.policy) if args.policy else Policy()
    except PolicyError as exc:
        raise UsageError(str(exc)) from None
    if args.tokenizer is not None and not args.tokenizer.is_file():
        raise UsageError(f"--tokenizer {args.tokenizer}: no such file")
    from decodeservice.proxy.upstream_health import UpstreamHealth

    try:
        health = UpstreamHealth.for_engine(args.engine_kind, path=args.upstream_health_path)
    except ValueError as exc:
        raise UsageError(f"--upstream-health-path: {exc}") from None

    from decodeservice.common.lifecycle import Lifecycle, Phase
    from decodeservice.proxy.app import create_app
    from decodeservice.proxy.serve import serve

    lifecycle = Lifecycle(phase=Phase.READY)
    try:
        app = create_app(policy, upstream, tokenizer_path=str(args.tokenizer) if args.tokenizer else None,
                         lifecycle=lifecycle, engine_kind=args.engine_kind, upstream_health=health)
    except Exception as exc:  # a tokenizer file that does not load
        raise UsageError(f"cannot start the proxy: {exc}") from None
    serve(app, lifecycle=lifecycle, host=args.host, port=args.port, drain_timeout=args.drain_timeout_seconds,
          log_level=args.log_level)
    return 0
