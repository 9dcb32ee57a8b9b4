"""The engine at a base revision against the working tree (or another revision), on benchmarks/decode_step.py:
one decode step at 1 and 32 streams and a verify's step, in interleaved rounds (the order alternating), both
CPU dispatches; eager, or with `--compile` the compiled step (EngineConfig.compile). JSON out, with each
round's after/before ratio, their median and range, each child's time (start-up included: with --compile the
first child of a side compiles cold, the others load inductor's on-disk cache), and the load average.

    .venv/bin/python -P benchmarks/plan_before_after.py --base REV [--after REV] [--compile] [--rounds 3]
        [--dispatches native,avx2] --out FILE

Revisions are exported as base_revision.py does it; both sides run this tree's decode_step.py, whose calls
(Engine.from_pretrained, runner.execute, step) the revisions share. Ratios below 1 are the after side faster.
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
from dispatches import cpu_name

# (name, path into decode_step.py's JSON): milliseconds, lower is better
FIGURES = {
    "step_ms_1_stream": ("profile", "2_threads", "batch_1", "wall_ms_per_step"),
    "step_ms_32_streams": ("profile", "2_threads", "batch_32", "wall_ms_per_step"),
    "verify_step_ms_0_drafts": ("verify_row_cost", "step_ms_by_drafts", "0"),
    "verify_step_ms_4_drafts": ("verify_row_cost", "step_ms_by_drafts", "4"),
}


def run_side(pythonpath: Path | None, dispatch: str, out: Path, *, compile_step: bool) -> dict[str, Any]:
    env = side_env(pythonpath, dispatch)
    started, load = time.perf_counter(), load_average()
    subprocess.run([sys.executable, "-P", str(ROOT / "benchmarks" / "decode_step.py"), "--threads", "2", "--out",
                    str(out), *(["--compile"] if compile_step else [])],
                   env=env, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    result = json.loads(out.read_text())
    figures: dict[str, Any] = {}
    for name, keys in FIGURES.items():
        value: Any = result
        for key in keys:
            value = value[key]
        figures[name] = value
    return {"figures": figures, "load_average_before": load, "load_average_after": load_average(),
            "seconds": round(time.perf_counter() - started, 1)}


def main() -> int:
    args_parser = parser(__doc__)
    args_parser.add_argument("--after", help="git revision of the after side (default: the working tree)")
    args_parser.add_argument("--compile", action="store_true", help="time the compiled step (decode_step.py --compile)")
    args = args_parser.parse_args()
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, check=True, capture_output=True, text=True).stdout
    report: dict[str, Any] = {"base": args.base, "after": args.after or "working tree", "compile": args.compile,
                              "tree_head": head.strip(), "rounds": args.rounds,
                              "cpu": cpu_name(),
                              "by_dispatch": {}}
    with tempfile.TemporaryDirectory() as tmp:
        paths = {"before": export(args.base, Path(tmp) / "base"),
                 "after": export(args.after, Path(tmp) / "after") if args.after else None}
        for dispatch in args.dispatches.split(","):
            rounds = []
            for r in range(args.rounds):
                order = ("before", "after") if r % 2 == 0 else ("after", "before")
                sides = {side: run_side(paths[side], dispatch, Path(tmp) / f"{dispatch}-{r}-{side}.json",
                                        compile_step=args.compile) for side in order}
                rounds.append({"order": list(order), **sides})
                print(f"{dispatch} round {r}: " + ", ".join(
                    f"{side} {sides[side]['figures']} in {sides[side]['seconds']} s" for side in order), file=sys.stderr, flush=True)
            ratios = {name: [x["after"]["figures"][name] / x["before"]["figures"][name] for x in rounds]
                      for name in FIGURES}
            report["by_dispatch"][dispatch] = {
                "rounds": rounds,
                "after_over_before": {name: ratio_summary(v) for name, v in ratios.items()}}
            args.out.write_text(json.dumps(report, indent=1) + "\n")  # partial results survive a cut run
    print(json.dumps({d: v["after_over_before"] for d, v in report["by_dispatch"].items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
