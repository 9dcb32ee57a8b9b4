"""The quantized model's build at a base revision against the working tree: `build_model` of the bundled
model (load excluded) and the kernel plan's own seconds, with the plan read from a warm cache, so what is
timed is the per-load work (the self-check, the modules' construction), in interleaved rounds (the order
alternating), on each CPU dispatch asked for. JSON out with each round's after/before ratio, their median
and range, and the load average.

    .venv/bin/python -P benchmarks/kernel_plan_startup.py --base REV [--rounds 3] [--dispatches native,avx2] --out FILE

The base is exported as base_revision.py does it (`git archive REV engine` first on PYTHONPATH).
Ratios below 1 are the tree faster.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from base_revision import ROOT, export, load_average, parser, ratio_summary, side_env
from json_out import emit

# Run in each child: both revisions share load_model, resolve_model_path and build_model's signature.
CHILD = """
import json, sys, time
from decodeservice.engine.config import EngineConfig
from decodeservice.engine.engine import build_model
from decodeservice.engine.loader import load_model
from decodeservice.engine.loader.registry import resolve_model_path
import torch
torch.set_num_threads(2)
loaded = load_model(resolve_model_path("smollm2-135m"), dtype=torch.float32, native_int4=True)
config = EngineConfig(quantization="int4")
build_model(loaded.config, loaded.weights, config, int4=loaded.int4)  # warms the plan's cache and the kernels
start = time.perf_counter()
model = build_model(loaded.config, loaded.weights, config, int4=loaded.int4)
seconds = time.perf_counter() - start
plan = model.kernel_plan
print(json.dumps({"build_s": seconds, "plan_s": plan.seconds, "source_cached": plan.source != "measured"}))
"""


def run_side(pythonpath: Path | None, dispatch: str, cache: Path) -> dict[str, Any]:
    env = side_env(pythonpath, dispatch, DECODESERVICE_KERNEL_CACHE=str(cache))
    load = load_average()
    out = subprocess.run([sys.executable, "-P", "-c", CHILD], env=env, cwd=ROOT, check=True, capture_output=True,
                         text=True).stdout
    return {**json.loads(out.strip().splitlines()[-1]), "load_average_before": load}


def main() -> int:
    args = parser(__doc__).parse_args()
    started = time.perf_counter()
    result: dict[str, Any] = {"base": args.base, "rounds": args.rounds, "load_average_start": load_average(),
                              "dispatches": {}}
    with tempfile.TemporaryDirectory() as tmp:
        base = export(args.base, Path(tmp) / "base")
        for dispatch in args.dispatches.split(","):
            rounds = []
            for i in range(args.rounds):
                order = [("before", base), ("after", None)] if i % 2 == 0 else [("after", None), ("before", base)]
                # Each side its own plan cache: the revisions' plans may differ in layout, never in a shared file.
                sides = {name: run_side(path, dispatch, Path(tmp) / f"cache-{name}") for name, path in order}
                rounds.append({**sides, "build_ratio": sides["after"]["build_s"] / sides["before"]["build_s"],
                               "plan_ratio": sides["after"]["plan_s"] / sides["before"]["plan_s"]})
            summary = {key: ratio_summary(r[key] for r in rounds) for key in ("build_ratio", "plan_ratio")}
            result["dispatches"][dispatch] = {"rounds": rounds, "after_over_before": summary}
    result["load_average_end"] = load_average()
    result["seconds"] = round(time.perf_counter() - started, 1)
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
