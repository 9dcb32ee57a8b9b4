"""The installed packages stay free of test support: nothing in them imports `tests` or a fake."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _installed_folders() -> list[Path]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return [ROOT / folder for folder in config["tool"]["setuptools"]["package-dir"].values()]


def _imports_of_installed_modules() -> list[tuple[str, str]]:
    """(file, imported module) for every import in the installed folders."""
    found = []
    for folder in _installed_folders():
        for path in folder.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                found += [(str(path.relative_to(ROOT)), n) for n in names]
    return found


def test_no_installed_module_imports_test_support() -> None:
    offenders = [f"{path}: {name}" for path, name in _imports_of_installed_modules()
                 if name == "tests" or name.startswith("tests.") or "fake_engine" in name]
    assert offenders == []


def test_no_installed_module_imports_the_test_only_kmock() -> None:
    offenders = [f"{path}: {name}" for path, name in _imports_of_installed_modules()
                 if name == "kmock" or name.startswith("kmock.")]
    assert offenders == []


def test_the_installed_folders_are_found() -> None:
    names = {p.name for p in _installed_folders()}
    assert {"engine", "proxy", "operator", "cli", "loadgen", "common"} <= names


def test_the_image_copies_every_installed_folder() -> None:
    """`pip install .` in the Dockerfile sees only what was copied: a new package folder must be too."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    missing = [p.name for p in _installed_folders() if f"COPY {p.name} {p.name}" not in dockerfile]
    assert missing == []


def test_every_kernel_source_ships_in_the_wheel() -> None:
    """The C++ kernels are built at first use from their source, so a wheel without it (`pip install .` in the
    Dockerfile) silently runs the torch paths: each .cpp/.h must match its package's package-data."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_data: dict[str, list[str]] = config["package-data"]
    missing = []
    for package, folder in config["package-dir"].items():
        for path in (ROOT / folder).rglob("*"):
            if path.suffix not in (".cpp", ".h"):
                continue
            inner = path.parent.relative_to(ROOT / folder).parts
            owner = ".".join((package, *inner))
            if not any(path.match(pattern) for pattern in package_data.get(owner, [])):
                missing.append(f"{path.relative_to(ROOT)} (package {owner})")
    assert missing == []
