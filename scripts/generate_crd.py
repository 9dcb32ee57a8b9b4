"""Write what the engine's knob table generates, or check that it is current.

    python -P scripts/generate_crd.py           # rewrite the generated files
    python -P scripts/generate_crd.py --check   # exit 1 and name each stale file

- crds/decodeservice.yaml: the spec.engine block between its GENERATED markers (the rest of the CRD is
  written by hand), from decodeservice.operator.engine_schema.engine_crd_schema;
- charts/decodeservice-operator/crds/decodeservice.yaml: an identical copy of it;
- operator/engine_knobs.py: the knob fields of the operator's EngineSpec and SpeculativeSpec.

tests/test_defaults.py runs the check.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
CRD = ROOT / "crds" / "decodeservice.yaml"
CHART_CRD = ROOT / "charts" / "decodeservice-operator" / "crds" / "decodeservice.yaml"
KNOBS = ROOT / "operator" / "engine_knobs.py"
BEGIN = "# BEGIN GENERATED spec.engine: scripts/generate_crd.py, from the knob table in engine/config.py"
END = "# END GENERATED spec.engine"
INDENT = " " * 16  # spec.properties.engine in the CRD


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    # Long prose folds (as the hand-written parts of the CRD do); patterns and short strings stay plain.
    style = ">" if len(value) > 80 and " " in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


def _list(dumper: yaml.SafeDumper, value: list[object]) -> yaml.Node:
    flow = all(isinstance(v, str | int | float) for v in value)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", value, flow_style=flow)


_Dumper.add_representer(str, _str)
_Dumper.add_representer(list, _list)


def engine_block() -> str:
    from decodeservice.operator.engine_schema import engine_crd_schema

    text = yaml.dump({"engine": engine_crd_schema()}, Dumper=_Dumper, sort_keys=False, width=100,
                     default_flow_style=False, allow_unicode=True)
    return "".join(f"{INDENT}{line}\n" if line else "\n" for line in text.splitlines())


def generated_crd(current: str) -> str:
    head, found, rest = current.partition(f"{INDENT}{BEGIN}\n")
    _, found_end, tail = rest.partition(f"{INDENT}{END}\n")
    if not found or not found_end:
        raise SystemExit(f"{CRD}: the GENERATED markers for spec.engine are missing")
    return f"{head}{INDENT}{BEGIN}\n{engine_block()}{INDENT}{END}\n{tail}"


def generated_files() -> dict[Path, str]:
    from decodeservice.operator.engine_schema import engine_knobs_source

    crd = generated_crd(CRD.read_text(encoding="utf-8"))
    return {CRD: crd, CHART_CRD: crd, KNOBS: engine_knobs_source()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a generated file is stale")
    args = parser.parse_args(argv)
    stale = []
    for path, text in generated_files().items():
        if path.exists() and path.read_text(encoding="utf-8") == text:
            continue
        stale.append(path.relative_to(ROOT))
        if not args.check:
            path.write_text(text, encoding="utf-8")
    if args.check and stale:
        print(f"stale: {', '.join(map(str, stale))}; run python -P scripts/generate_crd.py", file=sys.stderr)
        return 1
    for path in stale:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
