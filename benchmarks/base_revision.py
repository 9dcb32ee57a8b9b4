"""What the before/after studies share (plan_before_after.py, kernel_plan_startup.py): the engine at a base
revision exported for their children to import, their command line, each side's environment, and the
after/before summary of their rounds.

The base is `git archive REV engine` as `decodeservice/engine` in a temporary folder that goes first on
the children's PYTHONPATH, in place of the editable install; the tree's side runs without it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
from collections.abc import Iterable
from pathlib import Path

from dispatches import AVX2_CAPS

ROOT = Path(__file__).resolve().parents[1]


def load_average() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def export(rev: str, into: Path) -> Path:
    """`rev`'s engine/ as `into`/decodeservice/engine; returns `into`, the folder for PYTHONPATH."""
    target = into / "decodeservice"
    target.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", rev, "engine"], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True)
    return into


def parser(doc: str | None) -> argparse.ArgumentParser:
    """--base, --rounds, --dispatches and --out, described by the first line of the study's `doc`."""
    parsed = argparse.ArgumentParser(description=doc.splitlines()[0] if doc else None)
    parsed.add_argument("--base", required=True, help="git revision of the engine to compare against")
    parsed.add_argument("--rounds", type=int, default=3)
    parsed.add_argument("--dispatches", default="native,avx2", help="native, avx2 or both (comma-separated)")
    parsed.add_argument("--out", type=Path, required=True)
    return parsed


def side_env(pythonpath: Path | None, dispatch: str, **extra: str) -> dict[str, str]:
    """A child's environment: the dispatch's caps, the base's engine first on the path (None: the tree's)."""
    env = {**os.environ, **(AVX2_CAPS if dispatch == "avx2" else {}), **extra}
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return env


def ratio_summary(ratios: Iterable[float]) -> dict[str, float]:
    values = list(ratios)
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3), "max": round(max(values), 3)}
