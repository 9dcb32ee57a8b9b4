"""Shared paths and loaders for the operator tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
CRD_PATH = ROOT / "crds" / "decodeservice.yaml"
CHART = ROOT / "charts" / "decodeservice-operator"


def load(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict)
    return data


def example_paths() -> list[Path]:
    return sorted(EXAMPLES.glob("*.yaml"))
