"""pyproject says what the code imports: the import graph of every installed package, read with ast.

- Every third-party import is declared: in the core dependencies, or in the extra that owns the module
  (OWNERS below: the modules that may import beyond the core, and which extra declares it).
- Every core dependency is imported somewhere, or is in INDIRECT with the place that uses it.
- A module that imports beyond the core, if the runtime can import it, does so lazily (inside a
  function), so `pip install decodeservice` without that extra still runs.
- Python code in string constants counts too (the pods' init container runs such a script in the image).
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import re
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

# Module (or package prefix) -> the extra that declares its imports beyond the core.
OWNERS = {
    "decodeservice.loadgen.report": "bench",  # matplotlib, only in plot()
    "decodeservice.monitoring.png": "bench",  # matplotlib, only in draw()
    "decodeservice.loadgen.kube_emulator": "test",  # kmock: tests and benchmarks only
    "decodeservice.operator.engines": "hf",  # huggingface_hub, in the init container's download script
}
# Core dependencies nobody imports by name, and where they are used (that text must appear there).
INDIRECT = {
    "kubernetes": ("decodeservice.operator.kube", "kopf.login_via_client"),
    "uvloop": ("decodeservice.proxy.serve", "uvloop"),  # uvicorn's loop="auto" picks it
    "ninja": ("decodeservice.engine.cpp_extensions", "torch.utils.cpp_extension"),  # it runs the ninja binary
}
# Imports in code that runs only in a peer's image, never in ours: not our dependencies.
PEER_IMAGE_IMPORTS = {
    "ray": "vLLM's image: a multi-node leader waits for its Ray workers (operator/engines.py)",
}


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass
class Module:
    name: str
    path: Path
    imports: dict[str, bool] = field(default_factory=dict)  # top-level name -> imported at module level


def _package_dirs() -> dict[str, Path]:
    setuptools = PYPROJECT["tool"]["setuptools"]
    dirs = {pkg: ROOT / path for pkg, path in setuptools["package-dir"].items()}
    out = {}
    for pkg in setuptools["packages"]:
        base = max((p for p in dirs if pkg == p or pkg.startswith(p + ".")), key=len)
        out[pkg] = dirs[base].joinpath(*pkg[len(base) + 1:].split(".")) if pkg != base else dirs[base]
    return out


def _imports(tree: ast.AST, into: dict[str, bool], *, module: str, top: bool) -> None:
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                into[alias.name] = into.get(alias.name, False) or top
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: inside our own package
                continue
            name = node.module or ""
            # `from pkg import mod` imports pkg.mod when that is a module; extra names cost nothing.
            for full in (name, *(f"{name}.{alias.name}" for alias in node.names)):
                into[full] = into.get(full, False) or top
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue  # typing only, never executed
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "import " in node.value:
            try:
                embedded = ast.parse(node.value)
            except SyntaxError:
                continue  # prose that mentions importing, not code
            _imports(embedded, into, module=module, top=False)  # runs elsewhere, never at our import time
        else:
            nested = isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            _imports(node, into, module=module, top=top and not nested)


def modules() -> list[Module]:
    found = []
    for pkg, folder in _package_dirs().items():
        for path in sorted(folder.glob("*.py")):
            name = pkg if path.stem == "__init__" else f"{pkg}.{path.stem}"
            mod = Module(name=name, path=path)
            _imports(ast.parse(path.read_text(encoding="utf-8")), mod.imports, module=name, top=True)
            found.append(mod)
    assert found
    return found


def owner(module: str) -> str | None:
    hits = [m for m in OWNERS if module == m or module.startswith(m + ".")]
    return OWNERS[max(hits, key=len)] if hits else None


@functools.cache
def _providers() -> dict[str, list[str]]:
    return dict(importlib.metadata.packages_distributions())  # scans every installed distribution: once


def distribution(name: str) -> str | None:
    """The distribution an import name comes from; None for the stdlib and for our own code."""
    top = name.split(".")[0]
    if top in sys.stdlib_module_names or top == "decodeservice" or top in PEER_IMAGE_IMPORTS:
        return None
    dists = _providers().get(top)
    assert dists, f"import {name!r}: no installed distribution provides it"
    return normalize(dists[0])


def declared() -> tuple[set[str], dict[str, set[str]]]:
    project = PYPROJECT["project"]
    core = {normalize(Requirement(r).name) for r in project["dependencies"]}
    extras = {extra: {normalize(Requirement(r).name) for r in reqs}
              for extra, reqs in project["optional-dependencies"].items()}
    return core, extras


def test_every_third_party_import_is_declared_where_its_module_belongs() -> None:
    core, extras = declared()
    missing = []
    for mod in modules():
        for name in mod.imports:
            dist = distribution(name)
            if dist is None or dist in core:
                continue
            extra = owner(mod.name)
            if extra is None or dist not in extras.get(extra, set()):
                missing.append(f"{mod.name} imports {name} ({dist}): declare it in the core or in "
                               f"the extra {extra or '(none owns this module)'}")
    assert missing == []


def test_every_core_dependency_is_used() -> None:
    core, _ = declared()
    by_name = {m.name: m for m in modules()}
    imported = {distribution(name) for m in by_name.values() for name in m.imports}
    for dist, (module, text) in INDIRECT.items():
        assert text in by_name[module].path.read_text(encoding="utf-8"), f"{dist}: {module} no longer uses it"
        imported.add(dist)
    assert core - imported == set(), "declared in the core but never imported"


def test_optional_imports_are_lazy_where_the_runtime_reaches_them() -> None:
    core, _ = declared()
    mods = {m.name: m for m in modules()}
    # Modules imported at import time of any module that needs no extra (the runtime's closure).
    reached: set[str] = set()
    todo = [name for name in mods if owner(name) is None]
    while todo:
        name = todo.pop()
        if name in reached:
            continue
        reached.add(name)
        todo += [dep for dep, top in mods[name].imports.items() if top and dep in mods]
    eager = [f"{name} imports {dep} at module level" for name in sorted(reached) for dep, top in
             mods[name].imports.items() if top and (dist := distribution(dep)) is not None and dist not in core]
    assert eager == []
    assert "decodeservice.loadgen.kube_emulator" not in reached  # the test-only emulator stays out of the runtime


def test_the_test_extra_installs_the_other_extras_tests_need() -> None:
    _, extras = declared()
    assert "decodeservice" in extras["test"]  # decodeservice[bench]: tests plot reports
    assert {"bench", "hf"} <= set(extras)
