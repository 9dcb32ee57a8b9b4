"""Server-side apply and field ownership, as the API server does them, for the fields the operator uses.

Used by `kube_emulator.ApiServer` (tests and benchmarks); pure Python, no kmock. The model follows
structured-merge-diff, the API server's library, closely enough to test that fields disappear when the
operator stops applying them:

- Every write records which manager owns which fields in `metadata.managedFields` (FieldsV1 format:
  `f:` map keys, `k:{"name":...}` list items). An apply (`application/apply-patch+yaml`) makes the
  applier own exactly the fields of its configuration; a create or merge patch (an "Update") makes its
  manager own the fields whose value it changed, taking them from everyone else.
- Fields the applier owned before and no longer applies are removed, unless another manager still owns
  them (or something under them). Maps and lists emptied by a removal are removed too.
- A field another manager owns with a different value is a conflict: 409, unless `force=true`, which
  takes the field over.

What it does not model (a real cluster checks these): list merge keys other than `name` (the API server
keys container ports by containerPort, volumeMounts by mountPath, Service ports by port+protocol, and
treats tolerations as atomic; here every list of named maps is keyed by `name` and any other list is
atomic), `x-kubernetes-list-type=set` lists, defaulting and schema validation of the result, the
`status` subresource's separate field sets (status is never tracked here), and managers keyed by
operation and subresource beyond one Apply and one Update entry per manager.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

Path = tuple[str, ...]  # FieldsV1 tokens from the object's root: "f:spec", "f:replicas", 'k:{"name":"x"}'

# Identity and server-maintained fields: never owned by anyone.
_UNTRACKED_TOP = {"apiVersion", "kind", "status"}
_UNTRACKED_META = {"name", "namespace", "uid", "resourceVersion", "generation", "creationTimestamp",
                   "managedFields", "deletionTimestamp", "selfLink"}


class ApplyConflict(Exception):
    """The configuration sets fields that other managers own with other values (HTTP 409)."""

    def __init__(self, conflicts: list[tuple[str, Path]]) -> None:
        listed = "; ".join(f'conflict with "{m}": {_dotted(p)}' for m, p in conflicts)
        super().__init__(f"Apply failed with {len(conflicts)} conflict(s): {listed}")
        self.conflicts = conflicts


def _dotted(path: Path) -> str:
    return "".join("." + t[2:] if t.startswith("f:") else f"[{t[2:]}]" for t in path)


def _item_token(item: Mapping[str, Any]) -> str:
    return "k:" + json.dumps({"name": item["name"]}, separators=(",", ":"))


def _associative(value: Any) -> bool:
    """A list merged item by item: every element a map with a unique string `name`."""
    if not isinstance(value, list) or not value:
        return False
    names = [x.get("name") if isinstance(x, Mapping) else None for x in value]
    return all(isinstance(n, str) for n in names) and len(set(names)) == len(names)


def field_paths(obj: Mapping[str, Any]) -> set[Path]:
    """Every field an object sets: leaves, plus one path per item of an associative list."""
    paths: set[Path] = set()

    def walk(node: Mapping[str, Any], prefix: Path, top: bool) -> None:
        for key, value in node.items():
            if top and key in _UNTRACKED_TOP:
                continue
            if prefix == ("f:metadata",) and key in _UNTRACKED_META:
                continue
            path = (*prefix, f"f:{key}")
            if isinstance(value, Mapping) and value:
                walk(value, path, False)
            elif _associative(value):
                for item in value:
                    item_path = (*path, _item_token(item))
                    paths.add(item_path)
                    walk(item, item_path, False)
            else:
                paths.add(path)  # scalars, atomic lists, empty maps

    walk(obj, (), True)
    return paths


_MISSING = object()


def _child(node: Any, token: str) -> Any:
    if token.startswith("f:"):
        return node.get(token[2:], _MISSING) if isinstance(node, Mapping) else _MISSING
    if isinstance(node, list):
        name = json.loads(token[2:])["name"]
        for item in node:
            if isinstance(item, Mapping) and item.get("name") == name:
                return item
    return _MISSING


def value_at(obj: Any, path: Path) -> Any:
    node = obj
    for token in path:
        node = _child(node, token)
        if node is _MISSING:
            return _MISSING
    return node


def _remove(obj: dict[str, Any], path: Path) -> None:
    """Delete the field at `path`, then every map or list on the way up that this left empty."""
    parents: list[Any] = [obj]
    for token in path[:-1]:
        node = _child(parents[-1], token)
        if node is _MISSING:
            return
        parents.append(node)
    for depth in range(len(path) - 1, -1, -1):
        parent, token = parents[depth], path[depth]
        if token.startswith("f:"):
            parent.pop(token[2:], None)
        else:
            name = json.loads(token[2:])["name"]
            parent[:] = [x for x in parent if not (isinstance(x, Mapping) and x.get("name") == name)]
        if depth == 0 or parent:
            return  # only a container this removal emptied goes too


def _merge(live: Any, config: Any) -> Any:
    """Lay the configuration over the live object: maps by key, named lists by item, the rest replaced."""
    if isinstance(config, Mapping) and isinstance(live, Mapping):
        result = dict(live)
        for key, value in config.items():
            result[key] = _merge(live[key], value) if key in live else copy.deepcopy(value)
        return result
    if _associative(config) and isinstance(live, list) and all(isinstance(x, Mapping) for x in live):
        by_name = {x.get("name"): x for x in live}
        merged = [_merge(by_name[x["name"]], x) if x["name"] in by_name else copy.deepcopy(x) for x in config]
        applied = {x["name"] for x in config}
        return merged + [copy.deepcopy(x) for x in live if x.get("name") not in applied]
    return copy.deepcopy(config)


# --- managedFields <-> sets of paths -----------------------------------------------------------------

def _to_fields_v1(paths: set[Path]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for path in sorted(paths):
        node = tree
        for token in path:
            node = node.setdefault(token, {})
        if path and path[-1].startswith("k:"):
            node.setdefault(".", {})
    return tree


def _from_fields_v1(tree: Mapping[str, Any], prefix: Path = ()) -> set[Path]:
    paths: set[Path] = set()
    for token, sub in tree.items():
        if token == ".":
            paths.add(prefix)
            continue
        path = (*prefix, token)
        if sub:
            paths |= _from_fields_v1(sub, path)
        else:
            paths.add(path)
    return paths


Owners = dict[tuple[str, str], set[Path]]  # (manager, "Apply" | "Update") -> fields


def owners_of(obj: Mapping[str, Any] | None) -> Owners:
    owners: Owners = {}
    for entry in ((obj or {}).get("metadata") or {}).get("managedFields") or []:
        key = (str(entry.get("manager")), str(entry.get("operation")))
        owners[key] = _from_fields_v1(entry.get("fieldsV1") or {})
    return owners


def _managed_fields(owners: Owners, api_version: str) -> list[dict[str, Any]]:
    now = datetime.now(tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return [{"manager": m, "operation": op, "apiVersion": api_version, "time": now, "fieldsType": "FieldsV1",
             "fieldsV1": _to_fields_v1(paths)} for (m, op), paths in owners.items() if paths]


def _covers(paths: set[Path], path: Path) -> bool:
    """True when `paths` holds `path` or a field under it."""
    n = len(path)
    return any(p[:n] == path for p in paths)


def apply(live: Mapping[str, Any] | None, config: Mapping[str, Any], *, manager: str,
          force: bool) -> dict[str, Any]:
    """The object after `manager` applies `config` to `live` (None: the object does not exist yet)."""
    owners = owners_of(live)
    # A JSON round trip, not deepcopy: deepcopy keeps shared sub-objects shared, and removal mutates in place.
    base: dict[str, Any] = json.loads(json.dumps(live)) if live is not None else {}
    mine = (manager, "Apply")
    new = field_paths(config)
    conflicts = []
    for key, paths in owners.items():
        if key == mine:
            continue
        for path in sorted(new & paths):
            if value_at(base, path) != value_at(config, path) and not path[-1].startswith("k:"):
                conflicts.append((key[0], path))
                if force:
                    paths.discard(path)
    if conflicts and not force:
        raise ApplyConflict(conflicts)
    others = set().union(*(p for k, p in owners.items() if k != mine))
    dropped = {p for p in owners.get(mine, set()) - new if not _covers(others, p)}
    for path in dropped:
        # A whole list item goes at once: removing its `name` first would leave it unfindable.
        if not any(path[:n] in dropped for n in range(1, len(path))):
            _remove(base, path)
    result: dict[str, Any] = _merge(base, {k: v for k, v in config.items() if k != "status"})
    meta = dict(result.get("metadata") or {})
    meta.pop("managedFields", None)
    owners[mine] = new
    meta["managedFields"] = _managed_fields(owners, str(config.get("apiVersion", "")))
    result["metadata"] = meta
    return result


def record_update(old: Mapping[str, Any] | None, new: Mapping[str, Any], *, manager: str) -> list[dict[str, Any]]:
    """managedFields after a create or merge patch turned `old` into `new`: the writer owns what it changed."""
    owners = owners_of(old)
    after = field_paths(new)
    changed = {p for p in after if value_at(old or {}, p) != value_at(new, p)}
    for paths in owners.values():
        paths -= changed
        paths &= after  # a field the write deleted belongs to nobody any more
    key = (manager, "Update")
    owners[key] = (owners.get(key, set()) | changed) & after
    return _managed_fields(owners, str(new.get("apiVersion", "")))
