"""uvicorn with SIGTERM meaning "drain, then exit 0", for the engine server and the proxy alike.

uvicorn's own SIGTERM handling stops listening at once and re-raises the signal on the way out (exit
status 143). Kubernetes wants the opposite: keep answering probes (/ready now 503) while in-flight
streams finish, then exit cleanly. On the first SIGTERM the lifecycle turns DRAINING, new requests get
503, and once nothing is in flight (or `drain_timeout` has passed) uvicorn shuts down. A second
SIGTERM, or SIGINT, stops at once the way uvicorn normally does.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from types import FrameType

import uvicorn

from decodeservice.common.lifecycle import Lifecycle

log = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, *, lifecycle: Lifecycle, drain_timeout: float) -> None:
        super().__init__(config)
        self.lifecycle = lifecycle
        self.drain_timeout = drain_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self.lifecycle.bind(self._loop)
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGTERM or self.lifecycle.draining or self._loop is None:
            super().handle_exit(sig, frame)
            return
        # Not recorded in uvicorn's captured signals: re-raising SIGTERM after shutdown would make the
        # exit status -15 instead of 0.
        self.lifecycle.request_drain()
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._finish_drain())

    async def _finish_drain(self) -> None:
        log.info("SIGTERM: draining %d in-flight request(s), waiting up to %.0f s", self.lifecycle.inflight,
                 self.drain_timeout)
        if not await self.lifecycle.wait_idle(self.drain_timeout):
            log.warning("drain timeout (%.0f s) reached with %d request(s) in flight", self.drain_timeout,
                        self.lifecycle.inflight)
        self.should_exit = True
