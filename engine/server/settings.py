"""The HTTP server's own settings (the engine's live in EngineConfig)."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_BODY_BYTES = 1 << 20


@dataclass(frozen=True, kw_only=True)
class ServerSettings:
    served_model_name: str
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # SIGTERM: how long in-flight requests may take to finish before they are cut off.
    drain_timeout_s: float = 30.0
    # Chat requests without max_tokens may otherwise run to the end of the context.
    default_completion_max_tokens: int = 16

    def __post_init__(self) -> None:
        if not self.served_model_name:
            raise ValueError("served_model_name must not be empty")
        if self.max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be at least 1024")
        if self.drain_timeout_s < 0:
            raise ValueError("drain_timeout_s must be >= 0")
        if self.default_completion_max_tokens < 1:
            raise ValueError("default_completion_max_tokens must be >= 1")
