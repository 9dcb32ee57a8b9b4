"""The installed packages stay free of test support: nothing in them imports `tests` or a fake."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _installed_folders() -> list[Path]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return [ROOT / folder for folder in config["tool"]["setuptools"]["package-dir"].values()]


def test_no_installed_module_imports_test_support() -> None:
    offenders = []
    for folder in _installed_folders():
        for path in folder.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names
                              if n == "tests" or n.startswith("tests.") or "fake_engine" in n]
    assert offenders == []


def test_the_installed_folders_are_found() -> None:
    names = {p.name for p in _installed_folders()}
    assert {"engine", "proxy", "operator", "cli", "bench", "serving"} <= names


def test_the_image_copies_every_installed_folder() -> None:
    """`pip install .` in the Dockerfile sees only what was copied: a new package folder must be too."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    missing = [p.name for p in _installed_folders() if f"COPY {p.name} {p.name}" not in dockerfile]
    assert missing == []
