"""What the engine server's routes share: the state (lifecycle, engine, metrics), the request body's
parsing and the mapping of engine errors to OpenAI errors."""

from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from decodeservice.common.body import read_body
from decodeservice.common.errors import (
    BadRequest,
    Draining,
    NotFound,
    OpenAIError,
    ServerError,
    ServiceUnavailable,
)
from decodeservice.common.lifecycle import Lifecycle, Phase
from decodeservice.engine.async_engine import AsyncEngine
from decodeservice.engine.errors import EngineDeadError, EngineError, InvalidRequestError, PromptTooLongError
from decodeservice.engine.outputs import EngineStats
from decodeservice.engine.server.metrics import ServerMetrics
from decodeservice.engine.server.protocol import from_validation_error
from decodeservice.engine.server.settings import ServerSettings

M = TypeVar("M", bound=BaseModel)


class ServerState:
    """Everything the routes share; one per app."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.lifecycle = Lifecycle()
        self.aengine: AsyncEngine | None = None
        self.metrics = ServerMetrics(model_name=settings.served_model_name, stats=self._stats)
        self.exit_code = 0

    def _stats(self) -> EngineStats | None:
        return self.aengine.stats() if self.aengine is not None else None

    def engine_for_request(self) -> AsyncEngine:
        phase = self.lifecycle.phase
        if phase is Phase.DRAINING:
            raise Draining()
        if self.aengine is None or phase is not Phase.READY:
            raise ServiceUnavailable("the model is still loading" if phase is Phase.LOADING else
                                     f"the model failed to load: {self.lifecycle.failure}", code="not_ready")
        if not self.aengine.is_alive:
            raise ServerError(f"the engine loop has died: {self.aengine.dead_error!r}", code="engine_dead")
        return self.aengine

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.settings.served_model_name:
            raise NotFound(f"the model `{model}` does not exist; this server serves "
                           f"`{self.settings.served_model_name}`", param="model", code="model_not_found")


async def parse(request: Request, model: type[M], limit: int) -> M:
    body = await read_body(request.receive, limit=limit, content_length=request.headers.get("content-length"))
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        error = from_validation_error(exc)
        if exc.errors()[0]["type"] == "json_invalid":
            error = BadRequest(f"the body is not valid JSON: {exc.errors()[0]['msg']}", code="invalid_json")
        raise error from None


def engine_error(exc: EngineError) -> OpenAIError:
    if isinstance(exc, PromptTooLongError):
        return BadRequest(str(exc), param=exc.param, code="context_length_exceeded")
    if isinstance(exc, InvalidRequestError):
        return BadRequest(str(exc), param=exc.param, code="invalid_value")
    if isinstance(exc, EngineDeadError):
        return ServerError(str(exc), code="engine_dead")
    return ServerError(f"engine error: {exc}", code="engine_error")
