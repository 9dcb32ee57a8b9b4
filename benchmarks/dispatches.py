"""A benchmark run once per CPU dispatch, each in a child process (torch reads the caps when it starts):
`native`, and `avx2` with the caps scripts/test.sh uses, so one command measures both in one run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

AVX2_CAPS = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
RESULT = "RESULT "  # the line a child prints its JSON result on


def caps_in_effect() -> dict[str, str]:
    return {k: os.environ[k] for k in AVX2_CAPS if k in os.environ}


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
