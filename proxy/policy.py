"""The proxy policy: one typed schema, validated when it is built.

The same model is the CRD's `spec.policies`: the operator validates the custom resource with
`Policy.model_validate(spec["policies"])` and renders `policy.yaml` into a ConfigMap with `to_yaml()`;
the proxy reads it back with `Policy.from_yaml_file(path)`.

Field names on the wire are camelCase (Kubernetes convention); Python attributes are snake_case.
Every field has a default, so `{}` (or an empty file) is a valid policy. Unknown keys are rejected so a
typo cannot silently fall back to a default.

```yaml
outputLength:
  maxOutputTokens: 2048        # int >= 1
  mode: clamp                  # clamp | reject
  defaultMaxTokens: 256        # int >= 1, must be <= maxOutputTokens
  maxInputTokens: null         # optional int >= 1
  maxBodyBytes: 1048576        # int >= 1
slo:
  ttftMs: 1000                 # > 0
  itlMs: 200                   # > 0
  percentile: 95               # (0, 100]
  windowSeconds: 60            # attainment window
  firstTokenTimeoutMs: 60000   # > 0 or null (off): upstream send to first token event / response head
  streamStallTimeoutMs: 30000  # > 0 or null (off): longest upstream silence once tokens flow
admission:
  defaultClass: interactive    # interactive | batch
  maxInflight: 64
  tenantTokensPerMinute: null  # optional int
  isolatePrefixCache: false    # true: the engine's prefix cache is salted per x-tenant
classes:
  interactive: {batchWindowMs: 0, maxBatch: 1, maxQueue: 64}
  batch: {batchWindowMs: 20, maxBatch: 16, maxQueue: 256}
```
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Any, Self

import yaml
from pydantic import Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

from decodeservice.common.camel_model import CamelModel
from decodeservice.proxy.errors import PolicyError

__all__ = [
    "AdmissionPolicy",
    "ClassPolicy",
    "ClassesPolicy",
    "LengthMode",
    "OutputLengthPolicy",
    "Policy",
    "PolicyError",
    "PriorityClass",
    "SloPolicy",
]


# The shared camelCase base (decodeservice.common.camel_model); the short local name keeps this file's
# many class lines, and the branches that add to them, unchanged.
_Model = CamelModel


class LengthMode(enum.StrEnum):
    CLAMP = "clamp"
    REJECT = "reject"


class PriorityClass(enum.StrEnum):
    INTERACTIVE = "interactive"
    BATCH = "batch"


class OutputLengthPolicy(_Model):
    max_output_tokens: int = Field(default=2048, ge=1, description="Cap on max_tokens / max_completion_tokens.")
    mode: LengthMode = Field(default=LengthMode.CLAMP, description="clamp: lower the limit to the cap; reject: 400.")
    default_max_tokens: int = Field(default=256, ge=1, description="Injected when the client sends no limit.")
    max_input_tokens: int | None = Field(default=None, ge=1, description="Prompt token cap; null for none.")
    max_body_bytes: int = Field(default=1_048_576, ge=1, description="Larger request bodies get 413.")

    @model_validator(mode="after")
    def _default_within_cap(self) -> Self:
        if self.default_max_tokens > self.max_output_tokens:
            raise ValueError(
                f"defaultMaxTokens ({self.default_max_tokens}) must be <= maxOutputTokens ({self.max_output_tokens})"
            )
        return self


class SloPolicy(_Model):
    ttft_ms: float = Field(default=1000.0, gt=0, description="Time-to-first-token objective, milliseconds.")
    itl_ms: float = Field(default=200.0, gt=0, description="Inter-token latency objective, milliseconds.")
    percentile: float = Field(default=95.0, gt=0, le=100, description="Percentile the objectives apply to.")
    window_seconds: float = Field(default=60.0, gt=0, description="Sliding window for SLO attainment.")
    # Hard limits, not objectives: the proxy gives up on the upstream (504 before the response head,
    # else a terminal SSE error event) and closes the connection, so the engine aborts the request.
    # Defaults are generous on purpose: a 60 s first token covers a long prompt's prefill behind a full
    # queue on a slow replica, and 30 s of silence mid-stream is far beyond any decode step or
    # preemption a healthy engine takes, yet both end a hung engine long before a client's own timeout
    # (often 10 min). Null turns a limit off.
    first_token_timeout_ms: float | None = Field(
        default=60_000.0, gt=0,
        description="Upstream send to the first token event (the response head when not streaming); null: off.")
    stream_stall_timeout_ms: float | None = Field(
        default=30_000.0, gt=0, description="Longest gap between upstream chunks once tokens flow; null: off.")


class AdmissionPolicy(_Model):
    default_class: PriorityClass = Field(default=PriorityClass.INTERACTIVE, description="Class when no x-priority.")
    max_inflight: int = Field(default=64, ge=1, description="Concurrent requests forwarded to the upstream.")
    tenant_tokens_per_minute: int | None = Field(
        default=None, ge=1, description="Per-tenant (x-tenant) token bucket rate; null disables it."
    )
    isolate_prefix_cache: bool = Field(
        default=False, description="Set the engine's cache_salt from x-tenant, so tenants never share cached prefixes."
    )


class ClassPolicy(_Model):
    batch_window_ms: float = Field(default=0.0, ge=0, description="How long arrivals are held to release together.")
    max_batch: int = Field(default=1, ge=1, description="Release early once this many are held.")
    max_queue: int = Field(default=64, ge=1, description="Bound on requests waiting in this class.")


_CLASS_DEFAULTS: dict[str, dict[str, Any]] = {
    "interactive": {"batchWindowMs": 0, "maxBatch": 1, "maxQueue": 64},
    "batch": {"batchWindowMs": 20, "maxBatch": 16, "maxQueue": 256},
}


class ClassesPolicy(_Model):
    interactive: ClassPolicy = Field(default_factory=lambda: ClassPolicy.model_validate(_CLASS_DEFAULTS["interactive"]))
    batch: ClassPolicy = Field(default_factory=lambda: ClassPolicy.model_validate(_CLASS_DEFAULTS["batch"]))

    @model_validator(mode="before")
    @classmethod
    def _merge_class_defaults(cls, data: Any) -> Any:
        # A partial class (`batch: {maxQueue: 10}`) keeps that class's own defaults for the other keys,
        # not the generic ClassPolicy ones.
        if not isinstance(data, dict):
            return data
        merged = dict(data)
        for name, defaults in _CLASS_DEFAULTS.items():
            given = merged.get(name)
            if isinstance(given, dict):
                snake = {_snake_to_camel(k): v for k, v in given.items()}
                merged[name] = {**defaults, **snake}
        return merged

    def for_class(self, priority: PriorityClass) -> ClassPolicy:
        return self.interactive if priority is PriorityClass.INTERACTIVE else self.batch


def _snake_to_camel(key: str) -> str:
    return to_camel(key) if "_" in key else key


class Policy(_Model):
    output_length: OutputLengthPolicy = Field(default_factory=OutputLengthPolicy)
    slo: SloPolicy = Field(default_factory=SloPolicy)
    admission: AdmissionPolicy = Field(default_factory=AdmissionPolicy)
    classes: ClassesPolicy = Field(default_factory=ClassesPolicy)

    @classmethod
    def from_mapping(cls, data: Any, *, source: str = "policy") -> Policy:
        """Validate a parsed mapping (None means empty), raising PolicyError with every bad field named."""
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise PolicyError(f"{source}: expected a mapping at the top level, got {type(data).__name__}")
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise PolicyError(f"{source}: invalid policy:\n{_format_errors(exc)}") from None

    @classmethod
    def from_yaml(cls, text: str, *, source: str = "policy") -> Policy:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise PolicyError(f"{source}: not valid YAML: {exc}") from None
        return cls.from_mapping(data, source=source)

    @classmethod
    def from_yaml_file(cls, path: str | Path) -> Policy:
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise PolicyError(f"{path}: cannot read policy file: {exc}") from None
        return cls.from_yaml(text, source=str(path))

    def to_dict(self) -> dict[str, Any]:
        """The camelCase mapping, as the CRD's `spec.policies` and `policy.yaml` hold it."""
        return self.model_dump(mode="json", by_alias=True)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def _format_errors(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors(include_url=False):
        where = ".".join(str(part) for part in err["loc"]) or "(top level)"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown field"
        lines.append(f"  {where}: {msg}")
    return "\n".join(lines)
