"""Each engine default has one source, the config dataclasses; the CLI, the CRD and the README agree."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml

from decodeservice.cli.main import build_parser
from decodeservice.engine.config import CPU_KV_CACHE_GIB, EngineConfig, SpeculativeConfig, field_default
from decodeservice.engine.server.settings import ServerSettings
from decodeservice.operator.spec import EngineSpec, SpeculativeSpec

ROOT = Path(__file__).resolve().parents[1]
CRDS = [ROOT / "crds" / "decodeservice.yaml", ROOT / "charts" / "decodeservice-operator" / "crds" / "decodeservice.yaml"]

# `decodectl engine` flag -> (config class, field)
FLAGS = {
    "gpu_memory_fraction": (EngineConfig, "gpu_memory_fraction"),
    "max_num_seqs": (EngineConfig, "max_num_seqs"),
    "max_num_batched_tokens": (EngineConfig, "max_num_batched_tokens"),
    "dtype": (EngineConfig, "dtype"),
    "device": (EngineConfig, "device"),
    "num_speculative_tokens": (SpeculativeConfig, "num_tokens"),
    "max_body_bytes": (ServerSettings, "max_body_bytes"),
    "drain_timeout": (ServerSettings, "drain_timeout_s"),
}


def _engine_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser: argparse.ArgumentParser = sub.choices["engine"]
    return parser


@pytest.mark.parametrize("dest", sorted(FLAGS))
def test_cli_defaults_are_the_config_defaults(dest: str) -> None:
    cls, name = FLAGS[dest]
    assert _engine_parser().get_default(dest) == field_default(cls, name)


def test_cli_defaults_build_the_default_config() -> None:
    """Flags left alone give exactly `EngineConfig()`: no flag carries a default of its own."""
    from decodeservice.cli.engine_cmd import engine_kwargs

    args = _engine_parser().parse_args([])
    built = EngineConfig(**engine_kwargs(args))
    assert dataclasses.asdict(built) == dataclasses.asdict(EngineConfig())


def _crd_speculative(path: Path) -> dict[str, Any]:
    crd = yaml.safe_load(path.read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    props: dict[str, Any] = schema["properties"]["spec"]["properties"]["engine"]["properties"]["speculative"]
    return props


@pytest.mark.parametrize("path", CRDS, ids=lambda p: str(p.relative_to(ROOT)))
def test_crd_draft_count_is_the_engine_default(path: Path) -> None:
    default = field_default(SpeculativeConfig, "num_tokens")
    assert _crd_speculative(path)["properties"]["numTokens"]["default"] == default
    assert SpeculativeSpec().num_tokens == default


@pytest.mark.parametrize("path", CRDS, ids=lambda p: str(p.relative_to(ROOT)))
@pytest.mark.parametrize("field", ["w8a8", "compile"])
def test_crd_engine_switches_are_the_engine_defaults(path: Path, field: str) -> None:
    crd = yaml.safe_load(path.read_text())
    engine = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["engine"]
    assert engine["properties"][field]["default"] is field_default(EngineConfig, field)
    assert getattr(EngineSpec(), field) is field_default(EngineConfig, field)


def test_readme_states_the_config_defaults() -> None:
    readme = (ROOT / "README.md").read_text()
    for text in (
        f"`kv_cache_gib` (CPU default {CPU_KV_CACHE_GIB:g} GiB)",
        f"`max_num_seqs` (default {field_default(EngineConfig, 'max_num_seqs')})",
        f"`max_num_batched_tokens`\n  (default {field_default(EngineConfig, 'max_num_batched_tokens')})",
        f"(at most `num_tokens`, default {field_default(SpeculativeConfig, 'num_tokens')})",
        f"`disable_batch_size` (default {field_default(SpeculativeConfig, 'disable_batch_size')})",
        f"(default {field_default(SpeculativeConfig, 'draft_row_cost')}, measured on CPU)",
        f"`block_size`, default {field_default(EngineConfig, 'block_size')})",
    ):
        assert text in readme, f"README.md should say {text!r}"
