"""Run the app on uvicorn, with SIGTERM meaning "drain, then exit 0".

uvicorn's own SIGTERM handling stops listening at once and re-raises the signal on the way out (exit
status 143). Kubernetes wants the opposite: keep answering probes (/ready now 503) while in-flight
streams finish, then exit cleanly. A second SIGTERM, or SIGINT, stops at once as uvicorn would.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from types import FrameType

import uvicorn

from decodeservice.engine.engine import Engine
from decodeservice.engine.server.app import ServerState, build_app
from decodeservice.engine.server.lifecycle import Phase
from decodeservice.engine.server.settings import ServerSettings

# After the drain (or its grace period), connections still open get this long before being cut.
SHUTDOWN_GRACE_S = 2


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and self.state.lifecycle.phase is not Phase.DRAINING:
            self.state.lifecycle.request_drain()  # the app's drain task calls stop() when done
            return
        super().handle_exit(sig, frame)


def make_server(settings: ServerSettings, *, engine_factory: Callable[[], Engine], host: str, port: int,
                log_level: str = "info") -> DrainingServer:
    holder: list[DrainingServer] = []

    def stop() -> None:
        holder[0].should_exit = True

    app = build_app(settings, engine_factory=engine_factory, stop=stop)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=SHUTDOWN_GRACE_S, access_log=False)
    server = DrainingServer(config, app.state.server)
    holder.append(server)
    return server


def serve(settings: ServerSettings, *, engine_factory: Callable[[], Engine], host: str, port: int,
          log_level: str = "info") -> int:
    """Blocks until the server exits; returns the process exit code."""
    server = make_server(settings, engine_factory=engine_factory, host=host, port=port, log_level=log_level)
    server.run()
    return server.state.exit_code
