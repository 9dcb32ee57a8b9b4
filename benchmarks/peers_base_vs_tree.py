"""The engine at a base revision and the working tree against llama.cpp, interleaved: did the tree keep its
ratios to the peer on this machine? engine_vs_peers.py's int4 engine and llama.cpp lanes, one dispatch.

    .venv/bin/python -P benchmarks/peers_base_vs_tree.py --base REV [--rounds 3] [--dispatches avx2] --out FILE

Per round three children of engine_vs_peers.py (`--threads 2 --decode-tokens 32 --repeats 1 --rounds 1`):
the base's engine (`engine_int4`, its engine/ exported first on PYTHONPATH as base_revision.py does), the
tree's, and llama.cpp (`llama_cpp`, the `peers` extra; llama.cpp ignores the caps: build it for the
dispatch compared). Per round: each side's TTFT, chat decode tok/s and 32-stream aggregate, and each
engine's ratio to that round's llama.cpp (TTFT lower is better, the others higher).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from base_revision import ROOT, export, load_average, parser, ratio_summary, side_env
from dispatches import cpu_name
from json_out import emit

FIGURES = {"ttft_s": "ttft_s", "decode_tok_s": "decode_tokens_per_s_chat",
           "aggregate_32_tok_s": "aggregate_32_streams_tokens_per_s"}


def run_child(variant: str, pythonpath: Path | None, dispatch: str, out: Path) -> dict[str, Any]:
    subprocess.run([sys.executable, "-P", str(ROOT / "benchmarks" / "engine_vs_peers.py"), "--threads", "2",
                    "--decode-tokens", "32", "--repeats", "1", "--rounds", "1", "--profile-threads", "2",
                    "--variants", variant, "--out", str(out)],
                   env=side_env(pythonpath, dispatch), cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    result = json.loads(out.read_text())["variants"][variant]
    if "skipped" in result:
        raise SystemExit(f"{variant}: {result['skipped']}")
    figures: dict[str, Any] = {name: float(result[key]) for name, key in FIGURES.items()}
    if "system_info" in result:  # llama.cpp's: which of its kernels the installed build has
        figures["system_info"] = result["system_info"]
    return figures


def main() -> int:
    args = parser(__doc__).parse_args()
    result: dict[str, Any] = {"base": args.base, "cpu": cpu_name(), "rounds": args.rounds, "by_dispatch": {}}
    with tempfile.TemporaryDirectory() as folder:
        base_path = export(args.base, Path(folder) / "base")
        for dispatch in args.dispatches.split(","):
            rounds = []
            for r in range(args.rounds):
                row: dict[str, Any] = {"load_average_before": load_average()}
                for side, variant, path in (("base", "engine_int4", base_path), ("tree", "engine_int4", None),
                                            ("llama_cpp", "llama_cpp", None)):
                    row[side] = run_child(variant, path, dispatch, Path(folder) / f"{dispatch}_{r}_{side}.json")
                for side in ("base", "tree"):
                    row[f"{side}_over_llama_cpp"] = {name: round(row[side][name] / row["llama_cpp"][name], 3)
                                                     for name in FIGURES}
                rounds.append(row)
                print(f"{dispatch} round {r}: {row}", file=sys.stderr, flush=True)
            result["by_dispatch"][dispatch] = {
                "rounds": rounds,
                **{f"{side}_over_llama_cpp": {name: ratio_summary(row[f"{side}_over_llama_cpp"][name] for row in rounds)
                                              for name in FIGURES} for side in ("base", "tree")}}
    result["command"] = "benchmarks/peers_base_vs_tree.py " + " ".join(sys.argv[1:])
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
