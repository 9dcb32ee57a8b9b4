"""The pydantic base of every user-written schema: the proxy policy and the DecodeService spec.

Field names on the wire are camelCase (the Kubernetes convention); Python attributes are snake_case,
and Python code may build models with either (validate_by_name). Unknown keys are rejected so a typo
cannot silently fall back to a default; models are frozen.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel


class CamelModel(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel,
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
        extra="forbid",
        frozen=True,
    )
