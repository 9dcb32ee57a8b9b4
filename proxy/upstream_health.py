"""Which upstream path tells the proxy's `/ready` that the engine can take requests.

The builtin engine (`decodectl engine`) splits liveness (`/health`) from readiness (`/ready`: the model
is loaded and the scheduler runs). vLLM's OpenAI server has no `/ready`: it listens only once the
engine is up, and its `/health` is 200 from then on, 503 (before 0.10: 500) once the engine died; see
tests/support/contracts/vllm/. So the path follows the engine kind (`decodectl proxy --engine-kind`,
which the operator renders from `spec.engine.kind`), and `--upstream-health-path` overrides it for any
other OpenAI-compatible server.
"""

from __future__ import annotations

import dataclasses
import enum

import httpx


class EngineKind(enum.StrEnum):
    BUILTIN = "builtin"
    VLLM = "vllm"


HEALTH_PATHS = {EngineKind.BUILTIN: "/ready", EngineKind.VLLM: "/health"}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class UpstreamHealth:
    """The path (and timeout) of the upstream check behind the proxy's `/ready`; 200 means ready."""

    path: str = HEALTH_PATHS[EngineKind.BUILTIN]
    timeout_s: float = 2.0

    def __post_init__(self) -> None:
        if not self.path.startswith("/") or any(c.isspace() for c in self.path) or "#" in self.path:
            raise ValueError(f"upstream health path must be an absolute path like /health, got {self.path!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"upstream health timeout must be > 0, got {self.timeout_s}")

    @classmethod
    def for_engine(cls, kind: EngineKind | str, *, path: str | None = None) -> UpstreamHealth:
        """The check for `kind`, or for `path` when given (an override)."""
        return cls(path=path if path is not None else HEALTH_PATHS[EngineKind(kind)])

    async def ready(self, client: httpx.AsyncClient, upstream_url: str) -> bool:
        try:
            response = await client.get(upstream_url.rstrip("/") + self.path, timeout=self.timeout_s)
        except httpx.HTTPError:
            return False
        return response.status_code == 200
