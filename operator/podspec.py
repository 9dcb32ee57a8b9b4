"""The core/v1 shapes a DecodeService passes through to its pods, typed and checked before they render.

spec.engine.env/envFrom, spec.model.tokenSecret and spec.pod (labels, annotations, affinity, topology
spread, runtime and priority class, image pull secrets). Field for field the upstream types (camelCase on
the wire), so they are copied into the pod as given; a bad value is an InvalidSpecError naming the field,
never a Deployment the API server refuses or a pod that cannot be scheduled. The CRD keeps affinity and
topologySpreadConstraints open (x-kubernetes-preserve-unknown-fields): these models are their schema.
"""

from __future__ import annotations

import enum
import re
from typing import Any

from pydantic import Field, field_validator, model_validator

from decodeservice.common.camel_model import CamelModel

QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti)?$"
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
ENV_NAME = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"
CONFIG_KEY = r"^[-._a-zA-Z0-9]+$"
LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_SUBDOMAIN = re.compile(DNS_SUBDOMAIN)
# Prefixes the operator's own labels and annotations use: a pod label there could break its selector.
RESERVED_PREFIXES = ("decode.dev/", "app.kubernetes.io/")


def check_qualified_name(key: str) -> str:
    """A label or annotation key: [DNS-subdomain prefix/]name, the name at most 63 characters."""
    prefix, _, name = key.rpartition("/")
    if prefix and (len(prefix) > 253 or not _SUBDOMAIN.match(prefix)):
        raise ValueError(f"{key!r}: the prefix must be a DNS subdomain")
    if len(name) > 63 or not _NAME.match(name):
        raise ValueError(f"{key!r}: the name must be 1-63 alphanumerics, '-', '_' or '.', starting and ending "
                         "with an alphanumeric")
    if key.startswith(RESERVED_PREFIXES):
        raise ValueError(f"{key!r}: the {', '.join(RESERVED_PREFIXES)} prefixes are the operator's")
    return key


class ObjectName(CamelModel):
    name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN)


class KeyRef(CamelModel):
    name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN)
    key: str = Field(min_length=1, max_length=253, pattern=CONFIG_KEY)
    optional: bool | None = None


class FieldRef(CamelModel):
    field_path: str = Field(min_length=1)
    api_version: str | None = None


class ResourceFieldRef(CamelModel):
    resource: str = Field(min_length=1)
    container_name: str | None = None
    divisor: str | None = None


class EnvVarSource(CamelModel):
    secret_key_ref: KeyRef | None = None
    config_map_key_ref: KeyRef | None = None
    field_ref: FieldRef | None = None
    resource_field_ref: ResourceFieldRef | None = None

    @model_validator(mode="after")
    def _one(self) -> EnvVarSource:
        if len(self.model_dump(exclude_none=True)) != 1:
            raise ValueError("valueFrom takes exactly one of secretKeyRef, configMapKeyRef, fieldRef, "
                             "resourceFieldRef")
        return self


class EnvVar(CamelModel):
    name: str = Field(min_length=1, pattern=ENV_NAME)
    value: str | None = None
    value_from: EnvVarSource | None = None

    @model_validator(mode="after")
    def _value_or_source(self) -> EnvVar:
        if self.value is not None and self.value_from is not None:
            raise ValueError(f"env {self.name}: value and valueFrom are exclusive")
        return self


class SourceRef(CamelModel):
    name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN)
    optional: bool | None = None


class EnvFromSource(CamelModel):
    prefix: str | None = Field(None, pattern=ENV_NAME)
    secret_ref: SourceRef | None = None
    config_map_ref: SourceRef | None = None

    @model_validator(mode="after")
    def _one(self) -> EnvFromSource:
        if (self.secret_ref is None) == (self.config_map_ref is None):
            raise ValueError("envFrom takes exactly one of secretRef and configMapRef")
        return self


class TokenSecret(CamelModel):
    """A Secret holding a Hugging Face token, given to the model download as HF_TOKEN (gated models)."""

    name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN)
    key: str = Field("token", min_length=1, max_length=253, pattern=CONFIG_KEY)


# --- scheduling -----------------------------------------------------------------------------------------

class NodeOperator(enum.StrEnum):
    IN = "In"
    NOT_IN = "NotIn"
    EXISTS = "Exists"
    DOES_NOT_EXIST = "DoesNotExist"
    GT = "Gt"
    LT = "Lt"


class NodeSelectorRequirement(CamelModel):
    key: str = Field(min_length=1)
    operator: NodeOperator
    values: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _values(self) -> NodeSelectorRequirement:
        wants = {"In": "some", "NotIn": "some", "Exists": "none", "DoesNotExist": "none", "Gt": "one", "Lt": "one"}
        need, n = wants[self.operator.value], len(self.values)
        if (need == "some" and n == 0) or (need == "none" and n) or (need == "one" and n != 1):
            raise ValueError(f"{self.key} {self.operator.value}: takes {need} values, got {n}")
        return self


class NodeSelectorTerm(CamelModel):
    match_expressions: tuple[NodeSelectorRequirement, ...] = ()
    match_fields: tuple[NodeSelectorRequirement, ...] = ()


class NodeSelector(CamelModel):
    node_selector_terms: tuple[NodeSelectorTerm, ...] = Field(min_length=1)


class PreferredSchedulingTerm(CamelModel):
    weight: int = Field(ge=1, le=100)
    preference: NodeSelectorTerm


class NodeAffinity(CamelModel):
    required_during_scheduling_ignored_during_execution: NodeSelector | None = None
    preferred_during_scheduling_ignored_during_execution: tuple[PreferredSchedulingTerm, ...] = ()


class LabelOperator(enum.StrEnum):
    IN = "In"
    NOT_IN = "NotIn"
    EXISTS = "Exists"
    DOES_NOT_EXIST = "DoesNotExist"


class LabelSelectorRequirement(CamelModel):
    key: str = Field(min_length=1)
    operator: LabelOperator
    values: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _values(self) -> LabelSelectorRequirement:
        if (self.operator in (LabelOperator.IN, LabelOperator.NOT_IN)) != bool(self.values):
            raise ValueError(f"{self.key} {self.operator.value}: In and NotIn take values, Exists and "
                             "DoesNotExist none")
        return self


class LabelSelector(CamelModel):
    match_labels: dict[str, str] = Field(default_factory=dict)
    match_expressions: tuple[LabelSelectorRequirement, ...] = ()


class PodAffinityTerm(CamelModel):
    label_selector: LabelSelector | None = None
    namespaces: tuple[str, ...] = ()
    topology_key: str = Field(min_length=1)
    namespace_selector: LabelSelector | None = None
    match_label_keys: tuple[str, ...] = ()
    mismatch_label_keys: tuple[str, ...] = ()


class WeightedPodAffinityTerm(CamelModel):
    weight: int = Field(ge=1, le=100)
    pod_affinity_term: PodAffinityTerm


class PodAffinity(CamelModel):
    required_during_scheduling_ignored_during_execution: tuple[PodAffinityTerm, ...] = ()
    preferred_during_scheduling_ignored_during_execution: tuple[WeightedPodAffinityTerm, ...] = ()


class Affinity(CamelModel):
    node_affinity: NodeAffinity | None = None
    pod_affinity: PodAffinity | None = None
    pod_anti_affinity: PodAffinity | None = None


class Policy(enum.StrEnum):
    HONOR = "Honor"
    IGNORE = "Ignore"


class TopologySpreadConstraint(CamelModel):
    """As upstream; a constraint without labelSelector spreads this service's own pods."""

    max_skew: int = Field(ge=1)
    topology_key: str = Field(min_length=1)
    when_unsatisfiable: str = Field(pattern=r"^(DoNotSchedule|ScheduleAnyway)$")
    label_selector: LabelSelector | None = None
    min_domains: int | None = Field(None, ge=1)
    node_affinity_policy: Policy | None = None
    node_taints_policy: Policy | None = None
    match_label_keys: tuple[str, ...] = ()


class PodSpec(CamelModel):
    """What the pods get besides what the operator sets (nodeSelector and tolerations: spec.resources)."""

    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)
    affinity: Affinity | None = None
    topology_spread_constraints: tuple[TopologySpreadConstraint, ...] = ()
    runtime_class_name: str | None = Field(None, min_length=1, max_length=253, pattern=DNS_SUBDOMAIN)
    priority_class_name: str | None = Field(None, min_length=1, max_length=253, pattern=DNS_SUBDOMAIN)
    image_pull_secrets: tuple[ObjectName, ...] = ()

    @field_validator("labels")
    @classmethod
    def _labels(cls, labels: dict[str, str]) -> dict[str, str]:
        for key, value in labels.items():
            check_qualified_name(key)
            if len(value) > 63 or not re.match(LABEL_VALUE, value):
                raise ValueError(f"label {key}: {value!r} is not a label value (63 alphanumerics, '-', '_', '.')")
        return labels

    @field_validator("annotations")
    @classmethod
    def _annotations(cls, annotations: dict[str, str]) -> dict[str, str]:
        for key in annotations:
            check_qualified_name(key)
            if key.startswith("prometheus.io/"):
                raise ValueError(f"{key!r}: the operator sets the prometheus.io/ annotations (the proxy's /metrics)")
        if sum(len(k) + len(v) for k, v in annotations.items()) > 256 * 1024:
            raise ValueError("annotations may hold 256 KiB in all")
        return annotations


def dump(model: CamelModel | tuple[CamelModel, ...]) -> Any:
    """The wire form (camelCase, unset fields left out) to copy into a manifest."""
    if isinstance(model, tuple):
        return [dump(m) for m in model]
    return model.model_dump(mode="json", by_alias=True, exclude_none=True, exclude_defaults=True)
