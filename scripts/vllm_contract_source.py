"""vLLM's source as the recorder reads it (a wheel or a folder), and its route table.

The routes are followed from the API server's `register_api_routers` through every function it imports
and calls (`attach_router`, `register_*`), each `include_router` and each route declared inside a
function, collecting the `if` tests (and early `if not X: return`s) each route is registered under.
Used by scripts/record_vllm_contract.py, which explains the rest.
"""

from __future__ import annotations

import ast
import hashlib
import re
import zipfile
from pathlib import Path
from typing import Any

E = "vllm/entrypoints/"
REGISTRAR = (E + "launchers/api_server/routers.py", "register_api_routers")


class Source:
    """vLLM's files, from a wheel (read in place) or a directory holding `vllm/`."""

    def __init__(self, *, wheel: Path | None = None, root: Path | None = None) -> None:
        self.wheel = wheel
        self.root = root
        self._zip = zipfile.ZipFile(wheel) if wheel else None

    def read(self, name: str) -> str | None:
        if self._zip is not None:
            try:
                return self._zip.read(name).decode("utf-8")
            except KeyError:
                return None
        assert self.root is not None
        path = self.root / name
        return path.read_text(encoding="utf-8") if path.is_file() else None

    def need(self, name: str) -> str:
        text = self.read(name)
        if text is None:
            raise SystemExit(f"{name}: not in this vLLM source; the layout changed, update this script")
        return text

    def python_files(self) -> list[str]:
        if self._zip is not None:
            return [n for n in self._zip.namelist() if n.startswith("vllm/") and n.endswith(".py")]
        assert self.root is not None
        return [str(p.relative_to(self.root)) for p in (self.root / "vllm").rglob("*.py")]

    def license(self) -> str:
        if self._zip is not None:
            for name in self._zip.namelist():
                if name.endswith(".dist-info/METADATA"):
                    meta = self._zip.read(name).decode("utf-8")
                    if m := re.search(r"^License(?:-Expression)?: (.+)$", meta, re.M):
                        return m[1].strip()
        text = self.read("LICENSE") or ""
        return "Apache-2.0" if "Apache License" in text and "Version 2.0" in text else "unknown"

    def origin(self) -> str:
        if self.wheel is not None:
            digest = hashlib.sha256(self.wheel.read_bytes()).hexdigest()
            return f"{self.wheel.name} (sha256 {digest})"
        return f"source tree {self.root}"


def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _condition(node: ast.AST, parents: dict[ast.AST, ast.AST], *, functions: bool = True,
               stop: ast.AST | None = None) -> str | None:
    """The `if` tests (and, with `functions`, the enclosing functions) a node sits under, up to `stop`."""
    parts: list[str] = []
    child, up = node, parents.get(node)
    while up is not None and up is not stop:
        if isinstance(up, ast.If):
            test = ast.unparse(up.test)
            parts.append(test if child in up.body else f"not ({test})")
        elif functions and isinstance(up, ast.FunctionDef | ast.AsyncFunctionDef) and child is not node:
            parts.append(f"inside {up.name}()")
        child, up = up, parents.get(up)
    return " and ".join(reversed(parts)) or None


def _join(*conds: str | None) -> str | None:
    return " and ".join(f"({c})" if " or " in c else c for c in conds if c) or None


def _module_file(module: str, *, level: int, here: str) -> str:
    """`from <module> import` as a file name (a package's __init__.py or a module's .py), relative to `here`."""
    if level:
        base = here.rsplit("/", level)[0]
        name = f"{base}/{module.replace('.', '/')}" if module else base
    else:
        name = module.replace(".", "/")
    return name


def _decorated_routes(node: ast.AST, file: str) -> list[tuple[ast.AST, dict[str, Any]]]:
    out = []
    for fn in ast.walk(node):
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            for deco in fn.decorator_list:
                if (isinstance(deco, ast.Call) and isinstance(deco.func, ast.Attribute)
                        and isinstance(deco.func.value, ast.Name) and deco.func.value.id == "router"
                        and deco.args and isinstance(deco.args[0], ast.Constant)):
                    out.append((fn, {"method": deco.func.attr.upper(), "path": deco.args[0].value,
                                     "handler": fn.name, "file": file, "line": deco.lineno}))
        elif (isinstance(fn, ast.Call) and isinstance(fn.func, ast.Attribute) and fn.func.attr == "add_api_route"
              and fn.args and isinstance(fn.args[0], ast.Constant)):
            methods = next((k.value for k in fn.keywords if k.arg == "methods"), None)
            for method in ast.literal_eval(methods) if methods is not None else ["GET"]:
                out.append((fn, {"method": method, "path": fn.args[0].value, "file": file, "line": fn.lineno,
                                 "handler": ast.unparse(fn.args[1]) if len(fn.args) > 1 else None}))
        elif (isinstance(fn, ast.Call) and isinstance(fn.func, ast.Name) and fn.func.id == "Mount"
              and fn.args and isinstance(fn.args[0], ast.Constant)):
            out.append((fn, {"method": "GET", "path": fn.args[0].value, "handler": ast.unparse(fn.args[1]),
                             "file": file, "line": fn.lineno, "mount": True}))
    return out


class _Walk:
    """Follows the API server's router registration from `register_api_routers`: each function reached
    imports the next (`from X import attach_router`) and calls it, or includes a router, under its `if`s."""

    def __init__(self, src: Source) -> None:
        self.src = src
        self.routes: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.seen: set[tuple[str, str]] = set()

    def _file(self, name: str) -> tuple[str, str] | None:
        for candidate in (f"{name}.py", f"{name}/__init__.py"):
            if (text := self.src.read(candidate)) is not None:
                return candidate, text
        return None

    def function(self, file: str, name: str, cond: str | None) -> None:
        if (file, name) in self.seen:
            return
        self.seen.add((file, name))
        text = self.src.need(file)
        tree = ast.parse(text)
        parents = _parents(tree)
        fn = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name), None)
        if fn is None:
            raise SystemExit(f"{file}: no function {name}(); the router registration changed, update this script")
        imported: dict[str, tuple[str, str]] = {}  # local name -> (file, name there)
        local_functions = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        guards: list[str] = []  # `if not X: return` early in the function guards what follows
        for stmt in fn.body:
            self._statement(stmt, file, parents, fn, _join(cond, *guards), imported, local_functions)
            if isinstance(stmt, ast.If) and not stmt.orelse and isinstance(stmt.body[-1], ast.Return):
                guards.append(f"not ({ast.unparse(stmt.test)})")

    def _statement(self, stmt: ast.stmt, file: str, parents: dict[ast.AST, ast.AST], fn: ast.FunctionDef,
                   cond: str | None, imported: dict[str, tuple[str, str]], local_functions: set[str]) -> None:
        for node in ast.walk(stmt):
            local = _join(cond, _condition(node, parents, functions=False, stop=fn))
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("vllm.entrypoints")):
                for alias in node.names:
                    target = _module_file(node.module or "", level=node.level, here=file)
                    sub = self._file(f"{target}/{alias.name}") if alias.name == "router" else None
                    found = self._file(target)
                    if found is not None:
                        imported[alias.asname or alias.name] = (found[0], alias.name)
                    elif sub is not None:
                        imported[alias.asname or alias.name] = (sub[0], alias.name)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in imported:
                target_file, target_name = imported[node.func.id]
                self.function(target_file, target_name, local)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in local_functions:
                self.function(file, node.func.id, local)
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr == "include_router" and node.args and isinstance(node.args[0], ast.Name)):
                arg = node.args[0].id
                router_file = imported[arg][0] if arg in imported else file
                self.module_routes(router_file, local)
        for route_node, route in _decorated_routes(stmt, file):  # routes declared inside the function
            self.add(route, _join(cond, _condition(route_node, parents, functions=False, stop=fn)))

    def module_routes(self, file: str, cond: str | None) -> None:
        tree = ast.parse(self.src.need(file))
        parents = _parents(tree)
        for route_node, route in _decorated_routes(tree, file):
            if not any(isinstance(p, ast.FunctionDef) for p in _ancestors(route_node, parents)):
                self.add(route, _join(cond, _condition(route_node, parents, functions=False)))

    def add(self, route: dict[str, Any], cond: str | None) -> None:
        key = (route["method"], route["path"], route["file"])
        if key in self.routes and self.routes[key]["condition"] is None:
            return
        self.routes[key] = {**route, "condition": cond}


def _ancestors(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> list[ast.AST]:
    out = []
    while (node := parents.get(node)) is not None:  # type: ignore[assignment]
        out.append(node)
    return out


def routes(src: Source) -> list[dict[str, Any]]:
    walk = _Walk(src)
    walk.function(*REGISTRAR, None)
    return sorted(walk.routes.values(), key=lambda r: (r["path"], r["method"], r["file"]))
