"""spec.engine, generated from the engine's knob table (engine/config.py).

Each engine knob with a `crd` name becomes, from its one definition (type, default, bounds, help):
- its property in the CRD's spec.engine openAPIV3Schema (`engine_crd_schema`),
- its pydantic field in the operator's EngineSpec (`engine_knobs_source`, written to operator/engine_knobs.py),
- its flag in the builtin engine's args (`knob_args`, used by operator/engines.py).

The CEL rules attached to spec.engine are copied from `CEL_RULES`, where each has its Python twin.
scripts/generate_crd.py writes the generated files; tests/test_defaults.py fails when one is stale. Fields
that are the operator's own (kind, image, extraArgs, ...) are written here once, as schema.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from typing import Any

from pydantic.alias_generators import to_camel

from decodeservice.engine.config import EngineConfig, KnobField, SpeculativeConfig, knob_fields
from decodeservice.operator.cel_rules import CEL_RULES

# The operator's names for the knobs' choices (enums in operator/engine_knobs.py).
ENUM_NAMES = {"quantization": "Quantization", "kv_cache_dtype": "KVCacheDtype", "method": "SpecMethod"}
_TYPES: dict[type, str] = {int: "integer", float: "number", bool: "boolean", str: "string"}


def crd_knobs(cls: type[Any]) -> tuple[KnobField, ...]:
    return tuple(kf for kf in knob_fields(cls) if kf.knob.crd is not None)


def _number(value: float, kind: type) -> int | float:
    return int(value) if kind is int or float(value).is_integer() else float(value)


def description(kf: KnobField) -> str:
    text = kf.knob.help[:1].upper() + kf.knob.help[1:] + "."
    if not kf.knob.crd_default and kf.default is not None:
        text += f" Unset: each engine's own default (the builtin engine's is {kf.default})."
    return f"{text} {kf.knob.note}".strip()


def knob_schema(kf: KnobField) -> dict[str, Any]:
    k = kf.knob
    schema: dict[str, Any] = {"type": _TYPES[kf.kind]}
    if kf.choices:
        schema["enum"] = list(kf.choices)
    if k.minimum is not None:
        if k.exclusive_minimum:
            schema["exclusiveMinimum"] = True
        schema["minimum"] = _number(k.minimum, kf.kind)
    if k.maximum is not None:
        if k.exclusive_maximum:
            schema["exclusiveMaximum"] = True
        schema["maximum"] = _number(k.maximum, kf.kind)
    if k.crd_default and kf.default is not None:
        schema["default"] = kf.default
    schema["description"] = description(kf)
    return schema


def _rules(path: tuple[str, ...]) -> list[dict[str, str]]:
    return [{"rule": r.rule, "message": r.message} for r in CEL_RULES if r.path == path]


def _object(description: str, properties: Mapping[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object", "default": {}, "description": description}
    rules = _rules(path)
    if rules:
        schema["x-kubernetes-validations"] = rules
    schema["properties"] = dict(properties)
    return schema


def operator_engine_properties() -> dict[str, dict[str, Any]]:
    """spec.engine's fields that are the operator's, not the engine's."""
    return {
        "kind": {"type": "string", "enum": ["builtin", "vllm"], "default": "builtin",
                 "description": "builtin runs `decodectl engine`; vllm runs vLLM's OpenAI server."},
        "image": {"type": "string", "minLength": 1,
                  "description": "Engine image; defaults to the operator's image (builtin) or its vLLM image."},
    }


def _draft_model_schema() -> dict[str, Any]:
    from decodeservice.operator.spec import MODEL_URI_PATTERN

    return {"type": "string", "maxLength": 512, "pattern": MODEL_URI_PATTERN,
            "description": "Draft model uri (same forms as model.uri); required for method draft."}


def engine_crd_schema() -> dict[str, Any]:
    """The CRD's spec.engine: the operator's fields, then every knob of EngineConfig, then speculation."""
    props: dict[str, Any] = operator_engine_properties()
    props.update({str(kf.knob.crd): knob_schema(kf) for kf in crd_knobs(EngineConfig)})
    speculative = {str(kf.knob.crd): knob_schema(kf) for kf in crd_knobs(SpeculativeConfig)}
    speculative["draftModel"] = _draft_model_schema()
    props["speculative"] = _object("Speculative decoding.", speculative, ("engine", "speculative"))
    props["extraArgs"] = {"type": "array", "default": [], "maxItems": 64,
                          "description": "Extra command-line arguments appended to the engine's.",
                          "items": {"type": "string"}}
    props.update(_env_properties())
    return _object("The inference engine behind the proxy.", props, ("engine",))


def _ref(what: str, *, key: bool) -> dict[str, Any]:
    props: dict[str, Any] = {"name": {"type": "string", "description": f"Name of the {what}."}}
    if key:
        props["key"] = {"type": "string", "description": f"Key in the {what}."}
    props["optional"] = {"type": "boolean", "description": f"Whether the {what} may be missing."}
    return {"type": "object", "required": ["name", "key"] if key else ["name"], "description": f"A {what}.",
            "properties": props}


def _env_properties() -> dict[str, Any]:
    """The engine container's env and envFrom, as core/v1 has them (operator/podspec.py checks them)."""
    value_from = {
        "type": "object", "description": "Where the value comes from (exactly one source).",
        "properties": {
            "secretKeyRef": _ref("Secret", key=True), "configMapKeyRef": _ref("ConfigMap", key=True),
            "fieldRef": {"type": "object", "required": ["fieldPath"], "description": "A field of the pod.",
                         "properties": {"fieldPath": {"type": "string", "description": "Path of the field."},
                                        "apiVersion": {"type": "string", "description": "Its API version."}}},
            "resourceFieldRef": {"type": "object", "required": ["resource"],
                                 "description": "A resource of the container.", "properties": {
                                     "resource": {"type": "string", "description": "Resource name."},
                                     "containerName": {"type": "string", "description": "Container name."},
                                     "divisor": {"type": "string", "description": "Divisor of the value."}}}}}
    env_var = {"type": "object", "required": ["name"], "description": "A core/v1 EnvVar.", "properties": {
        "name": {"type": "string", "minLength": 1, "description": "Variable name (not one the operator sets)."},
        "value": {"type": "string", "description": "Literal value."},
        "valueFrom": value_from}}
    env_from = {"type": "object", "description": "A core/v1 EnvFromSource (exactly one of the refs).",
                "properties": {"prefix": {"type": "string", "description": "Prefix for every variable name."},
                               "secretRef": _ref("Secret", key=False),
                               "configMapRef": _ref("ConfigMap", key=False)}}
    return {
        "env": {"type": "array", "default": [], "maxItems": 128, "items": env_var,
                "description": "Extra environment of the engine container (for example secrets for vLLM)."},
        "envFrom": {"type": "array", "default": [], "maxItems": 32, "items": env_from,
                    "description": "Secrets and ConfigMaps whose keys become the engine container's environment."},
    }


# --- operator/engine_knobs.py ---------------------------------------------------------------------------

def _py(value: Any) -> str:
    return json.dumps(value) if isinstance(value, str) else repr(value)


def _annotation(kf: KnobField) -> str:
    base = ENUM_NAMES[kf.name] if kf.choices else kf.kind.__name__
    return f"{base} | None" if kf.optional or not kf.knob.crd_default else base


def _field_line(kf: KnobField) -> str:
    k = kf.knob
    unset = kf.optional or not k.crd_default
    default = "None" if unset else (f"{ENUM_NAMES[kf.name]}.{str(kf.default).upper()}" if kf.choices
                                    else _py(kf.default))
    args = [default]
    if k.minimum is not None:
        args.append(f"{'gt' if k.exclusive_minimum else 'ge'}={_number(k.minimum, kf.kind)!r}")
    if k.maximum is not None:
        args.append(f"{'lt' if k.exclusive_maximum else 'le'}={_number(k.maximum, kf.kind)!r}")
    if k.crd != to_camel(kf.name):
        args.append(f"alias={_py(k.crd)}")
    value = default if len(args) == 1 else f"Field({', '.join(args)})"
    return f"    {kf.name}: {_annotation(kf)} = {value}"


def _enum_lines(kf: KnobField) -> list[str]:
    name = ENUM_NAMES[kf.name]
    return ["", "", f"class {name}(enum.StrEnum):",
            *(f"    {c.upper()} = {_py(c)}" for c in kf.choices)]


def engine_knobs_source() -> str:
    """operator/engine_knobs.py: the pydantic fields of EngineSpec and SpeculativeSpec that are knobs."""
    engine, speculative = crd_knobs(EngineConfig), crd_knobs(SpeculativeConfig)
    lines = ['"""GENERATED by scripts/generate_crd.py from the knob table in engine/config.py: do not edit.',
             "",
             "The operator's EngineSpec and SpeculativeSpec (operator/spec.py) extend these classes.",
             '"""', "", "from __future__ import annotations", "", "import enum", "",
             "from pydantic import Field", "", "from decodeservice.common.camel_model import CamelModel"]
    for kf in (*engine, *speculative):
        if kf.choices:
            lines += _enum_lines(kf)
    for name, doc, knobs in (("EngineKnobs", "EngineConfig", engine),
                             ("SpeculativeKnobs", "SpeculativeConfig", speculative)):
        lines += ["", "", f"class {name}(CamelModel):", f'    """The {doc} knobs a DecodeService sets."""', "",
                  *(_field_line(kf) for kf in knobs)]
    return "\n".join(lines) + "\n"


# --- the builtin engine's args -------------------------------------------------------------------------

def _arg(value: Any, kind: type) -> str:
    if isinstance(value, enum.Enum):
        value = value.value
    if kind is float:
        return str(int(value)) if float(value).is_integer() else repr(float(value))
    return str(value)


def knob_args(values: Any, cls: type[Any]) -> list[str]:
    """`decodectl engine` flags for the knobs `values` (an EngineSpec or SpeculativeSpec) sets; unset
    ones are left out, so the engine applies its own default."""
    args: list[str] = []
    for kf in crd_knobs(cls):
        flag, value = kf.knob.flag, getattr(values, kf.name)
        if flag is None or value is None:
            continue
        if kf.kind is bool:
            if value != kf.default:
                args.append(flag if value else f"--no-{flag.removeprefix('--')}")
            continue
        args += [flag, _arg(value, kf.kind)]
    return args
