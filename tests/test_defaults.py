"""Each engine knob has one source, its field in the config dataclasses (engine/config.py): the CLI, the
operator's spec and args and the CRD are generated from it and agree; the README states the defaults."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from pydantic import BaseModel, ValidationError

from decodeservice.cli.engine_cmd import SPECULATIVE_DEST, engine_kwargs
from decodeservice.cli.main import build_parser
from decodeservice.engine.config import (
    CPU_KV_CACHE_GIB,
    EngineConfig,
    KnobField,
    SpeculativeConfig,
    field_default,
    knob_fields,
)
from decodeservice.engine.errors import ConfigError
from decodeservice.operator.engine_schema import crd_knobs
from decodeservice.operator.engines import builtin_args, plan_models
from decodeservice.operator.spec import EngineSpec, SpeculativeSpec, validate_spec

ROOT = Path(__file__).resolve().parents[1]
CRDS = [ROOT / "crds" / "decodeservice.yaml", ROOT / "charts" / "decodeservice-operator" / "crds" / "decodeservice.yaml"]
SCRIPT = ROOT / "scripts" / "generate_crd.py"
KNOBS = [(EngineConfig, kf) for kf in knob_fields(EngineConfig)] + [(SpeculativeConfig, kf)
                                                                    for kf in knob_fields(SpeculativeConfig)]
CRD_KNOBS = [(c, kf) for c, kf in KNOBS if kf.knob.crd]


def _id(item: tuple[type, KnobField]) -> str:
    return f"{item[0].__name__}.{item[1].name}"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("generate_crd", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_files_are_current() -> None:
    files = _script().generated_files()
    assert set(files) == {*CRDS, ROOT / "operator" / "engine_knobs.py"}
    stale = [str(p.relative_to(ROOT)) for p, text in files.items() if p.read_text(encoding="utf-8") != text]
    assert stale == [], f"stale generated files {stale}: run python -P scripts/generate_crd.py"


def test_generator_check_fails_on_a_hand_edit(tmp_path: Path) -> None:
    script = _script()
    current = CRDS[0].read_text(encoding="utf-8")
    edited = current.replace("                      minimum: 1\n", "                      minimum: 2\n", 1)
    assert edited != current and script.generated_crd(edited) == current  # the block is regenerated whole
    with pytest.raises(SystemExit, match="markers"):
        script.generated_crd(current.replace(script.BEGIN, "# gone"))
    run = subprocess.run([sys.executable, "-P", str(SCRIPT), "--check"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr


def _engine_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser: argparse.ArgumentParser = sub.choices["engine"]
    return parser


@pytest.mark.parametrize("item", [i for i in KNOBS if i[1].knob.flag], ids=_id)
def test_cli_defaults_are_the_config_defaults(item: tuple[type, KnobField]) -> None:
    cls, kf = item
    dest = (SPECULATIVE_DEST if cls is SpeculativeConfig else "") + kf.name
    assert _engine_parser().get_default(dest) == kf.default
    option = next(a for a in _engine_parser()._actions if a.dest == dest)
    assert kf.knob.flag in option.option_strings and kf.knob.help in (option.help or "")


def test_cli_defaults_build_the_default_config() -> None:
    """Flags left alone give exactly `EngineConfig()`: no flag carries a default of its own."""
    args = _engine_parser().parse_args([])
    built = EngineConfig(**engine_kwargs(args))
    assert dataclasses.asdict(built) == dataclasses.asdict(EngineConfig())


def _crd_props(path: Path, cls: type) -> dict[str, Any]:
    crd = yaml.safe_load(path.read_text())
    engine = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["engine"]
    props: dict[str, Any] = engine["properties"]
    return props["speculative"]["properties"] if cls is SpeculativeConfig else props


@pytest.mark.parametrize("path", CRDS, ids=lambda p: str(p.relative_to(ROOT)))
@pytest.mark.parametrize("item", CRD_KNOBS, ids=_id)
def test_crd_and_spec_defaults_are_the_engine_defaults(path: Path, item: tuple[type, KnobField]) -> None:
    cls, kf = item
    schema = _crd_props(path, cls)[kf.knob.crd]
    model: BaseModel = SpeculativeSpec() if cls is SpeculativeConfig else EngineSpec()
    if kf.knob.crd_default and kf.default is not None:
        assert schema["default"] == kf.default and getattr(model, kf.name) == kf.default
    else:  # unset in the manifest: each engine applies its own default, nothing is passed
        assert "default" not in schema and getattr(model, kf.name) is None


def _edges(kf: KnobField) -> list[tuple[Any, bool]]:
    """Values at and just past each bound, with whether they are in bounds."""
    k, step = kf.knob, (1 if kf.kind is int else 1e-6)
    out: list[tuple[Any, bool]] = []
    if k.minimum is not None:
        out += [(kf.kind(k.minimum), not k.exclusive_minimum), (kf.kind(k.minimum - step), False)]
    if k.maximum is not None:
        out += [(kf.kind(k.maximum), not k.exclusive_maximum), (kf.kind(k.maximum + step), False)]
    return out + [(c, True) for c in kf.values] + ([("bogus", False)] if kf.values else [])


@pytest.mark.parametrize("item", [i for i in CRD_KNOBS if _edges(i[1])], ids=_id)
def test_spec_and_engine_agree_on_every_bound(item: tuple[type, KnobField]) -> None:
    cls, kf = item
    for value, ok in _edges(kf):
        spec_ok = engine_ok = True
        try:
            (SpeculativeSpec if cls is SpeculativeConfig else EngineSpec).model_validate({kf.knob.crd: value})
        except ValidationError:
            spec_ok = False
        base: dict[str, Any] = {"method": "ngram", "draft_model": "d"} if cls is SpeculativeConfig else {}
        try:
            cls(**{**base, kf.name: value})
        except ConfigError:
            engine_ok = False
        assert (spec_ok, engine_ok) == (ok, ok), (kf.name, value)


def test_builtin_args_parse_back_to_the_spec_values() -> None:
    """What the operator renders for the builtin engine is what `decodectl engine` reads, knob for knob."""
    raw = {"model": {"uri": "bundled://smollm2-135m"},
           "engine": {"maxNumSeqs": 7, "kvCacheGiB": 0.5, "quantization": "int4", "w8a8": True, "compile": True,
                      "kvCacheDtype": "int8", "speculative": {"method": "ngram", "numTokens": 3}}}
    v = validate_spec(raw)
    args = builtin_args(v, plan_models(v))
    kwargs = engine_kwargs(build_parser().parse_args(args))
    assert (kwargs["max_num_seqs"], kwargs["kv_cache_gib"], kwargs["quantization"]) == (7, 0.5, "int4")
    assert kwargs["w8a8"] is True and kwargs["compile"] is True and kwargs["kv_cache_dtype"] == "int8"
    assert SpeculativeConfig(**kwargs["speculative"]) == SpeculativeConfig(method="ngram", num_tokens=3)
    # Unset knobs are not rendered: the pod gets the engine's defaults, the same as the CLI's.
    plain = validate_spec({"model": {"uri": "bundled://smollm2-135m"}})
    plain_kwargs = engine_kwargs(build_parser().parse_args(builtin_args(plain, plan_models(plain))))
    assert plain_kwargs["max_num_seqs"] == field_default(EngineConfig, "max_num_seqs") == 64
    assert "speculative" not in plain_kwargs
    assert {kf.knob.crd for kf in crd_knobs(EngineConfig)} == {
        "kvCacheGiB", "gpuMemoryFraction", "maxNumSeqs", "quantization", "w8a8", "compile", "kvCacheDtype",
        "deterministic"}
    exact = validate_spec({"model": {"uri": "bundled://smollm2-135m"}, "engine": {"deterministic": True}})
    assert engine_kwargs(build_parser().parse_args(builtin_args(exact, plan_models(exact))))["deterministic"] is True


def test_readme_states_the_config_defaults() -> None:
    # The README or the pages under docs/ it points to.
    readme = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))])
    for text in (
        f"`kv_cache_gib` (CPU default {CPU_KV_CACHE_GIB:g} GiB)",
        f"`max_num_seqs` (default {field_default(EngineConfig, 'max_num_seqs')})",
        f"`max_num_batched_tokens`\n  (default {field_default(EngineConfig, 'max_num_batched_tokens')})",
        f"(at most `num_tokens`, default {field_default(SpeculativeConfig, 'num_tokens')})",
        f"`disable_batch_size` (default {field_default(SpeculativeConfig, 'disable_batch_size')})",
        "`draft_row_cost` of a decode step (unset by default: measured at start-up on this machine and model)",
        f"`block_size`, default {field_default(EngineConfig, 'block_size')})",
    ):
        assert text in readme, f"README.md or docs/ should say {text!r}"
