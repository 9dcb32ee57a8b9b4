"""Validate DecodeService objects against the CRD the way the API server would, without one.

1. Defaults from the schema are applied (structural defaulting).
2. The openAPIV3Schema is checked with jsonschema (Draft 4 semantics: boolean exclusiveMinimum; the
   OpenAPI `nullable` is rewritten as a JSON-schema null type).
3. The `x-kubernetes-validations` CEL rules are evaluated by a small CEL-to-Python translator that covers
   exactly the constructs our rules use (has(), !, &&, ||, ==, !=, <=, startsWith, field access). Its
   verdicts are compared with the Python twins in decodeservice.operator.spec.CEL_RULES.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from typing import Any

import jsonschema

from tests.operator.helpers import CRD_PATH, load


def crd() -> dict[str, Any]:
    return load(CRD_PATH)


def open_api_schema() -> dict[str, Any]:
    schema = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert isinstance(schema, dict)
    return schema


def apply_defaults(schema: dict[str, Any], obj: Any) -> Any:
    if not isinstance(obj, dict) or schema.get("type") != "object":
        if isinstance(obj, list) and "items" in schema:
            return [apply_defaults(schema["items"], item) for item in obj]
        return obj
    out = dict(obj)
    for key, sub in (schema.get("properties") or {}).items():
        if key not in out and "default" in sub:
            out[key] = copy.deepcopy(sub["default"])
        if key in out:
            out[key] = apply_defaults(sub, out[key])
    return out


def _jsonschema(schema: Any) -> Any:
    if isinstance(schema, dict):
        out = {k: _jsonschema(v) for k, v in schema.items() if not k.startswith("x-kubernetes-")}
        if out.pop("nullable", False):
            out["type"] = [out["type"], "null"]
        return out
    if isinstance(schema, list):
        return [_jsonschema(v) for v in schema]
    return schema


class _Node:
    """Attribute access over a dict, for evaluating translated CEL."""

    def __init__(self, value: dict[str, Any]) -> None:
        self._value = value

    def __getattr__(self, key: str) -> Any:
        value = self._value[key]
        return _Node(value) if isinstance(value, dict) else value


def _has(node: _Node, key: str) -> bool:
    return key in node._value


def cel_eval(rule: str, obj: dict[str, Any]) -> bool:
    expr = re.sub(r"has\((self(?:\.\w+)*)\.(\w+)\)", r"_has(\1, '\2')", rule)
    expr = expr.replace("&&", " and ").replace("||", " or ").replace(".startsWith(", ".startswith(")
    expr = re.sub(r"!(?!=)", " not ", expr)
    allowed = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_0123456789.'/:()<=>! ,")
    assert set(expr) <= allowed, f"unsupported CEL construct in {rule!r}"
    return bool(eval(expr, {"__builtins__": {}}, {"self": _Node(obj), "_has": _has}))


def cel_rules(schema: dict[str, Any], path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], dict[str, Any]]]:
    for rule in schema.get("x-kubernetes-validations") or []:
        yield path, rule
    for key, sub in (schema.get("properties") or {}).items():
        yield from cel_rules(sub, (*path, key))


def _at(obj: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(obj, dict) or key not in obj:
            return None
        obj = obj[key]
    return obj


def structural_errors(schema: dict[str, Any], obj: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """`obj` with the schema's defaults applied, and what the structural (OpenAPI) schema rejects in it."""
    defaulted = apply_defaults(schema, obj)
    validator = jsonschema.Draft4Validator(_jsonschema(schema))
    return defaulted, [f"{'.'.join(str(p) for p in e.absolute_path)}: {e.message}"
                       for e in validator.iter_errors(defaulted)]


def validate(obj: dict[str, Any]) -> list[str]:
    """Every error the API server would report for `obj`; empty when it would be accepted."""
    schema = open_api_schema()
    defaulted, errors = structural_errors(schema, obj)
    if errors:
        return errors  # as on the server, CEL runs only on objects that pass the structural schema
    for path, rule in cel_rules(schema):
        node = _at(defaulted, path)
        if isinstance(node, dict) and not cel_eval(rule["rule"], node):
            errors.append(f"{'.'.join(path)}: {rule['message']}")
    return errors
