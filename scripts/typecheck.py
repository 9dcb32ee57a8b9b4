"""Run mypy (strict) over the packages under their installed names.

The top-level folders are mapped to `decodeservice.*` by pyproject; mypy has no such mapping, so we
give it a tree of symlinks with the real layout and check that.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("engine", "proxy", "operator", "cli", "loadgen", "common", "monitoring", "router")


def main() -> int:
    shadow = ROOT / "build" / "typecheck" / "decodeservice"
    shadow.mkdir(parents=True, exist_ok=True)
    for name in FOLDERS:
        link = shadow / name
        if not link.is_symlink():
            link.symlink_to(ROOT / name, target_is_directory=True)
    cmd = [sys.executable, "-P", "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
           "--explicit-package-bases", "--namespace-packages", "-p", "decodeservice"]
    return subprocess.call(cmd, cwd=shadow.parent)


if __name__ == "__main__":
    sys.exit(main())
