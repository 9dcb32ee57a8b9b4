"""Running the proxy under uvicorn, with a draining SIGTERM.

On SIGTERM the proxy stops admitting (new requests and /ready get 503, so Kubernetes takes the pod out
of the Service), lets in-flight streams finish (up to `drain_timeout`), then shuts uvicorn down and
exits 0. A second SIGTERM, or SIGINT, stops at once the way uvicorn normally does.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from types import FrameType

import uvicorn
from starlette.types import ASGIApp

from decodeservice.proxy.app import DrainState

log = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, *, drain: DrainState, drain_timeout: float):
        super().__init__(config)
        self.drain = drain
        self.drain_timeout = drain_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGTERM or self.drain.draining or self._loop is None:
            super().handle_exit(sig, frame)
            return
        # Not recorded in uvicorn's captured signals: re-raising SIGTERM after shutdown would make the
        # exit status -15 instead of 0.
        self.drain.begin()
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._finish_drain())

    async def _finish_drain(self) -> None:
        log.info("SIGTERM: draining %d in-flight request(s)", self.drain.active)
        try:
            await asyncio.wait_for(self.drain.wait_idle(), timeout=self.drain_timeout)
        except TimeoutError:
            log.warning("drain timeout (%.0f s) reached with %d request(s) in flight", self.drain_timeout,
                        self.drain.active)
        self.should_exit = True


def serve(
    app: ASGIApp, *, drain: DrainState, host: str, port: int, drain_timeout: float = 30.0, log_level: str = "info"
) -> None:
    # uvloop and httptools when installed (they are dependencies), asyncio and h11 otherwise: measured
    # with benchmarks/proxy_overhead.py they cut the proxy's CPU per relayed token by about a tenth.
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=5, loop="auto", http="auto")
    DrainingServer(config, drain=drain, drain_timeout=drain_timeout).run()
