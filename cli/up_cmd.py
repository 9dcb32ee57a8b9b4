"""`decodectl up -f dsvc.yaml`: run a DecodeService's pod here, as the operator renders it, and serve.

The init containers, then the engine and the proxy, with their commands, args, env and probes exactly as
rendered (`decodectl render` shows them); the pod's paths map to folders under --workdir and it serves on
127.0.0.1:--port. With routing mode router (an autoscaled service's default) the router runs in front of
the pod as rendered, on --port, given the pod's proxy with `--endpoints` instead of an EndpointSlice watch. Try a manifest before deploying it. Ctrl-C stops it the way a pod stops (SIGTERM).
"""

from __future__ import annotations

import argparse
import socket
import tempfile
from pathlib import Path
from typing import Any

from decodeservice.cli.main import UsageError


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "up", help="run a DecodeService's rendered pod locally and serve it on 127.0.0.1",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-f", "--filename", required=True, help="DecodeService manifest (one document)")
    parser.add_argument("--port", type=int, default=8000, help="local port of the proxy (default 8000)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="folder for the pod's volumes (default: a new temporary folder)")
    parser.add_argument("--volume", action="append", default=[], metavar="NAME=PATH",
                        help="a local folder for one of the pod's volumes (needed for PVCs; repeatable)")
    parser.set_defaults(func=run)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def run(args: argparse.Namespace) -> int:
    import signal
    import threading

    import yaml

    from decodeservice.operator.engines import ENGINE_PORT, PROXY_PORT
    from decodeservice.operator.errors import InvalidSpecError
    from decodeservice.operator.local_pod import LocalPod, LocalPodError, plan_local_pod, run_local_pod
    from decodeservice.operator.manifests import render

    if not 0 < args.port < 65536:
        raise UsageError(f"--port {args.port} is not a TCP port")
    volumes: dict[str, Path] = {}
    for item in args.volume:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise UsageError(f"--volume {item!r}: expected NAME=PATH")
        volumes[name] = Path(path)
    try:
        body = yaml.safe_load(Path(args.filename).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise UsageError(f"cannot read {args.filename}: {exc}") from None
    if not isinstance(body, dict):
        raise UsageError(f"{args.filename}: expected one DecodeService mapping")
    with tempfile.TemporaryDirectory(prefix="decodectl-up-") as scratch:
        workdir = args.workdir or Path(scratch)
        try:
            children = render(body)
            # Routing mode router: the router takes --port and routes to the pod's proxy on a port of its own.
            routed = children.router is not None
            pod = plan_local_pod(children, workdir=workdir, volumes=volumes,
                                 ports={PROXY_PORT: _free_port() if routed else args.port, ENGINE_PORT: _free_port()},
                                 router_port=args.port if routed else None)
        except (InvalidSpecError, LocalPodError) as exc:
            raise UsageError(f"{args.filename}: {exc}") from None

        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())

        def ready(p: LocalPod) -> None:
            print(f"ready: {p.url} (OpenAI API at {p.url}/v1)", flush=True)

        try:
            return run_local_pod(pod, stop=stop, on_ready=ready)
        except LocalPodError as exc:
            print(f"decodectl up: {exc}", flush=True)
            return 1
