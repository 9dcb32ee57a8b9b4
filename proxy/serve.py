"""Running the proxy on the shared draining uvicorn server (`decodeservice.common.server`).

On SIGTERM the proxy stops admitting (new requests and /ready get 503, so Kubernetes takes the pod out
of the Service), lets in-flight streams finish (up to `drain_timeout`), then exits 0.
"""

from __future__ import annotations

import uvicorn
from starlette.types import ASGIApp

from decodeservice.common.lifecycle import Lifecycle
from decodeservice.common.server import DrainingServer


def serve(
    app: ASGIApp, *, lifecycle: Lifecycle, host: str, port: int, drain_timeout: float = 30.0,
    log_level: str = "info",
) -> None:
    # uvloop and httptools when installed (they are dependencies), asyncio and h11 otherwise: measured
    # with benchmarks/proxy_overhead.py they cut the proxy's CPU per relayed token by about a tenth.
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=5, loop="auto", http="auto")
    DrainingServer(config, lifecycle=lifecycle, drain_timeout=drain_timeout).run()
