"""How a study hands over its result: the JSON on stdout, and in FILE where `--out FILE` names one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def emit(result: dict[str, Any], out: Path | None, *, indent: int = 2) -> None:
    text = json.dumps(result, indent=indent)
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
