"""Run the engine's app on the shared draining uvicorn server (`decodeservice.common.server`).

SIGTERM turns /ready to 503 and refuses new generations, lets in-flight ones finish within
`drain_timeout_s`, then exits 0; a failed model load stops the server with exit code 1.
"""

from __future__ import annotations

from collections.abc import Callable

import uvicorn

from decodeservice.common.server import DrainingServer
from decodeservice.engine.engine import Engine
from decodeservice.engine.server.app import build_app
from decodeservice.engine.server.settings import ServerSettings
from decodeservice.engine.server.state import ServerState

# After the drain (or its grace period), connections still open get this long before being cut.
SHUTDOWN_GRACE_S = 2


class EngineServer(DrainingServer):
    """The shared draining server, holding the app's state (the engine) for embedders and tests."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config, lifecycle=state.lifecycle, drain_timeout=state.settings.drain_timeout_s)
        self.state = state


def make_server(settings: ServerSettings, *, engine_factory: Callable[[], Engine], host: str, port: int,
                log_level: str = "info") -> EngineServer:
    holder: list[EngineServer] = []

    def stop() -> None:
        holder[0].should_exit = True

    app = build_app(settings, engine_factory=engine_factory, stop=stop)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=SHUTDOWN_GRACE_S, access_log=False)
    server = EngineServer(config, app.state.server)
    holder.append(server)
    return server


def serve(settings: ServerSettings, *, engine_factory: Callable[[], Engine], host: str, port: int,
          log_level: str = "info") -> int:
    """Blocks until the server exits; returns the process exit code."""
    server = make_server(settings, engine_factory=engine_factory, host=host, port=port, log_level=log_level)
    server.run()
    return server.state.exit_code
