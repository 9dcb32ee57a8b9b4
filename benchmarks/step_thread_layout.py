"""Which thread builds the engine against which thread steps it: prefill and decode step times. JSON out.

    .venv/bin/python -P benchmarks/step_thread_layout.py [--rounds 3] [--requests 3] [--out FILE]

torch's CPU ops run their parallel regions on libgomp, which gives every thread that opens one a pool
of its own. A server loads the model on one thread and steps it on another; if the loading thread
stays alive (asyncio's executor keeps its threads), two pools live in the process. Layouts, each in a
fresh child process (a pool lives as long as its thread):

- `built_elsewhere`: the main thread builds, a second thread steps (the server before
  `AsyncEngine.launch`, and this benchmark's in-process lane before it);
- `built_on_step_thread`: one thread builds and steps (`AsyncEngine.launch`);
- `main_thread`: the main thread builds and steps (the in-process benchmarks).

Per layout and round: `--requests` chat requests one at a time (the served benchmark's ~490-token
prompt with a fresh opening, 64 tokens, `ignore_eos`), the prefill step and the median decode step.
Layouts alternate round by round, so load drifts across all of them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))  # `python -P` leaves the script's folder off the path
from dispatches import caps_in_effect, cpu_name
from json_out import emit

LAYOUTS = ("built_elsewhere", "built_on_step_thread", "main_thread")


def child(layout: str, requests: int) -> dict[str, Any]:
    from served_lanes import MODEL, add_chat
    from served_vs_peers import build_body, message

    from decodeservice.engine import Engine

    body = build_body(490)
    built: dict[str, Engine] = {}
    times: dict[str, list[float]] = {"prefill_ms": [], "decode_step_ms": []}

    def build() -> None:
        built["engine"] = Engine.from_pretrained(MODEL)

    def step_requests() -> None:
        if layout == "built_on_step_thread":
            build()
        engine = built["engine"]
        for _ in range(requests + 1):  # the first is a warm-up
            add_chat(engine, [{"role": "user", "content": message(body, uuid.uuid4().hex)}], max_tokens=64)
            steps = []
            while engine.has_unfinished_requests():
                start = time.perf_counter()
                engine.step()
                steps.append((time.perf_counter() - start) * 1000)
            times["prefill_ms"].append(steps[0])
            times["decode_step_ms"].append(statistics.median(steps[1:]))

    if layout != "built_on_step_thread":
        build()
    if layout == "main_thread":
        step_requests()
    else:
        worker = threading.Thread(target=step_requests)
        worker.start()
        worker.join()
    return {key: values[1:] for key, values in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--child", choices=LAYOUTS, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.requests)))
        return 0

    layouts = args.layouts.split(",")
    rounds: list[dict[str, Any]] = []
    for index in range(args.rounds):
        order = layouts[index % len(layouts):] + layouts[:index % len(layouts)]
        result: dict[str, Any] = {}
        for layout in order:
            load = os.getloadavg()[0]
            out = subprocess.run([sys.executable, "-P", __file__, "--child", layout, "--requests", str(args.requests)],
                                 capture_output=True, text=True, check=True).stdout
            result[layout] = {**json.loads(out.splitlines()[-1]), "load_avg_at_start": load}
            print(f"round {index + 1} {layout}: {json.dumps(result[layout])}", file=sys.stderr)
        rounds.append(result)
    summary = {layout: {key: statistics.median(v for r in rounds for v in r[layout][key])
                        for key in ("prefill_ms", "decode_step_ms")} for layout in layouts}
    ratios = {f"{layout}/built_on_step_thread {key}": summary[layout][key] / summary["built_on_step_thread"][key]
              for layout in layouts if layout != "built_on_step_thread" and "built_on_step_thread" in summary
              for key in ("prefill_ms", "decode_step_ms")}
    import torch

    emit({"machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "torch": torch.__version__,
                      "torch_threads": torch.get_num_threads()},
          "env": caps_in_effect(), "workload": {"prompt_tokens_target": 490, "output_tokens": 64,
                                                "requests_per_round": args.requests, "rounds": args.rounds},
          "medians": summary, "ratios": ratios, "rounds": rounds}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
