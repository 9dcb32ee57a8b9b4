"""A benchmark run once per CPU dispatch, each in a child process (torch reads the caps when it starts):
`native`, and `avx2` with the caps scripts/test.sh uses, so one command measures both in one run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

AVX2_CAPS = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
RESULT = "RESULT "  # the line a child prints its JSON result on


def caps_in_effect() -> dict[str, str]:
    return {k: os.environ[k] for k in AVX2_CAPS if k in os.environ}


def cpu_name() -> str:
    """/proc/cpuinfo's model name with its family and model numbers: what a result was measured on. A VM's
    model name can be bare ("AMD EPYC"): the family tells generations apart (AMD 25: Zen 3/4, 26: Zen 5)."""
    fields: dict[str, str] = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name", "unknown")
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    return name


def report(result: dict[str, Any]) -> None:
    """In the child: hand `result` to the parent."""
    print(RESULT + json.dumps(result), flush=True)


def run_child(script: str, dispatch: str, argv: list[str], *, cwd: Path) -> dict[str, Any]:
    """`script --child ARGV` under `dispatch`; its stderr passes through (progress), its result comes back."""
    env = {**os.environ, **(AVX2_CAPS if dispatch == "avx2" else {})}
    child = subprocess.run([sys.executable, "-P", script, "--child", *argv], env=env, cwd=cwd,
                           stdout=subprocess.PIPE, text=True, check=False)
    if child.returncode:
        sys.exit(f"{dispatch}: the child failed (exit {child.returncode}; its stderr is above)")
    line = next(x for x in child.stdout.splitlines() if x.startswith(RESULT))
    return dict(json.loads(line.removeprefix(RESULT)))


def run_study(script: str, *, dispatches: str, child: bool, run: dict[str, Any],
              measure: Callable[..., dict[str, Any]], shown: tuple[str, ...], out: Path) -> None:
    """A study per dispatch in one call. In the child (`child`): `measure(**run)`, handed to the parent. In the
    parent: a child per dispatch, each one's `shown` figures printed as it ends, then every result with the
    command and `run` written to `out`."""
    if child:
        report(measure(**run))
        return
    results: dict[str, Any] = {"command": " ".join([f"benchmarks/{Path(script).name}", *sys.argv[1:]]), **run}
    for dispatch in dispatches.split(","):
        results[dispatch] = run_child(script, dispatch, sys.argv[1:], cwd=Path(script).resolve().parent.parent)
        print(dispatch, json.dumps({k: results[dispatch][k] for k in shown}), flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {out}")
