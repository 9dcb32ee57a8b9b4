"""The engine as users call it: `decodectl engine` over HTTP vs vLLM's and llama.cpp's servers, with the
same engine in-process as the breakdown (what the server costs). JSON out.

    .venv/bin/python -P benchmarks/served_vs_peers.py [--rounds 3] [--lanes engine,in_process,vllm,llama_cpp]
        [--vllm-python PATH --vllm-model HF_DIR] [--llama-server PATH] [--out FILE]
        [--engine-variant 'NAME=--max-num-batched-tokens 1024' ...]

Each `--engine-variant` adds a lane `engine:NAME`, `decodectl engine` with those flags, interleaved with
the others in the same rounds, so a setting is compared with the default on one state of the machine;
leading NAME=VALUE words set the server's environment (`'spin=GOMP_SPINCOUNT=10000'`).

One client for every server (`decodectl bench`'s, loadgen/client.py): streamed chat, `temperature: 0`,
`ignore_eos: true`, a final usage chunk. The workload, per lane and round:
- one stream at a time (`--singles` requests): TTFT (send to first content chunk) and decode tokens/s
  ((output tokens - 1) / (end - first chunk)); medians over the requests;
  for HTTP lanes also the server's own TTFT (its `vllm:time_to_first_token_seconds` histogram, read from
  /metrics around the singles) and what the client waited beyond it (`outside_server_ttft_s`: HTTP, the
  chat template, tokenization, SSE);
- `--streams` requests sent at once: output tokens/s (all output tokens / first send to last end) and
  the TTFT median over the streams;
- the client's CPU per output token in each part (`client_cpu_ms_per_token_*`, this process's user and
  system time): it runs on the cores the server uses, so served / in-process charges it to the server.
Every request's prompt is a ~`--prompt-tokens`-token chat message that starts with a fresh random tag, so
no server finds a cached prefix. All servers are up for the whole run (idle ones wait on a socket) and
the rounds interleave the lanes, rotating their order, so each round sees one state of a shared machine;
before each lane the CPUs settle to idle (`settled_s`: vLLM keeps a core busy for ~1 s after its last
request, which had slowed the next lane's first request); figures are medians over rounds,
and each ratio is kept per round as well.

The `in_process` lane is the default engine driven directly (`Engine.add_request` / `step`) in a child
process that takes the same messages: the same template, the same clocks, no HTTP. served / in-process is
what the server costs. The CPU dispatch is the environment's: run once as is and once with
`ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2`; the children inherit it,
and the JSON records what torch reports.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

from decodeservice.loadgen.client import BenchRequest
from decodeservice.loadgen.procs import ChildServer, decodectl, free_port

sys.path.insert(0, str(Path(__file__).parent))  # `python -P` leaves the script's folder off the path
from dispatches import caps_in_effect, cpu_name
from json_out import emit
from served_lanes import MODEL, HttpLane, InProcessLane, Timed, settle

ARTICLE = (
    "The city council met on Tuesday to discuss the new public transport plan. The plan adds three bus "
    "lines, extends the tram to the northern districts, and replaces the oldest diesel buses with electric "
    "ones over the next five years. Supporters said the changes would cut commuting times and air "
    "pollution, while critics worried about the cost, estimated at 240 million euros, and about "
    "construction noise in residential streets. The mayor promised a public consultation in the spring "
    "and said that ticket prices would not rise before 2027. "
)
# vLLM's CPU docs: bind its OpenMP threads to the cores (here every one), its KV cache sized by the flag.
# PYTHONSAFEPATH: run from the checkout, whose operator/ folder would shadow the standard library's.
VLLM_ENV = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 1) - 1}", "PYTHONSAFEPATH": "1"}


# -- the prompt -------------------------------------------------------------------------------------
def build_body(target_tokens: int) -> str:
    """The message body whose chat rendering (with a tag) is about `target_tokens` tokens."""
    from decodeservice.engine.loader import ensure_model
    from decodeservice.engine.loader.gguf_loader import read_gguf_tokenizer

    tok = read_gguf_tokenizer(ensure_model(MODEL, progress=False))
    words = (ARTICLE * (target_tokens // 50 + 2)).split(" ")
    body = ""
    for end in range(1, len(words) + 1):
        body = " ".join(words[:end])
        text = tok.apply_chat_template([{"role": "user", "content": message(body, "0" * 32)}])
        if len(tok.encode(text, add_special_tokens=False)) >= target_tokens:
            break
    return body


def message(body: str, tag: str) -> str:
    # The tag comes first, so no two requests share a cached prefix past the template's few tokens.
    return f"[{tag}] Summarize the following report in three sentences.\n\n{body}"


def fresh(body: str, max_tokens: int) -> BenchRequest:
    return BenchRequest(id=uuid.uuid4().hex, max_tokens=max_tokens,
                        messages=(("user", message(body, uuid.uuid4().hex)),))


def summarize(singles: list[Timed], burst: list[Timed], output_tokens: int) -> dict[str, Any]:
    wall = max(t.end for t in burst) - min(t.start for t in burst)
    short = [t.tokens for t in singles + burst if t.tokens != output_tokens]
    decode = statistics.median(t.decode for t in singles)
    return {"ttft_s": statistics.median(t.ttft for t in singles),
            "decode_tokens_per_s": decode,
            "streams_output_tokens_per_s": sum(t.tokens for t in burst) / wall,
            # how the burst scales: its output tokens/s over one stream's decode tokens/s
            "streams_over_single": sum(t.tokens for t in burst) / wall / decode,
            "streams_ttft_p50_s": statistics.median(t.ttft for t in burst),
            "streams_wall_s": wall,
            "singles_ttft_s": [t.ttft for t in singles],
            **({"wrong_output_lengths": short} if short else {})}


def client_cpu_s() -> float:
    """This process's CPU seconds: the client's (an HTTP lane's), or the pipe reads of the in-process one."""
    times = os.times()
    return times.user + times.system


def client_cpu(singles_s: float, singles: list[Timed], burst_s: float, burst: list[Timed]) -> dict[str, float]:
    """The client's CPU per output token, on the same cores as the server it measures: part of what
    served / in-process charges the server (the in-process lane has no HTTP client)."""
    return {"client_cpu_ms_per_token_singles": 1000 * singles_s / max(1, sum(t.tokens for t in singles)),
            "client_cpu_ms_per_token_burst": 1000 * burst_s / max(1, sum(t.tokens for t in burst))}


def server_share(singles: list[Timed], before: tuple[float, float] | None,
                 after: tuple[float, float] | None) -> dict[str, float]:
    """Where the one-stream TTFT goes: the server's own clock (its TTFT histogram, from the request's arrival
    at the engine front to the first token there) against the client's; the rest is HTTP, parsing, the chat
    template and tokenization, and the SSE write and read."""
    if before is None or after is None or after[1] - before[1] != len(singles):
        return {}
    server = (after[0] - before[0]) / len(singles)
    client = statistics.fmean(t.ttft for t in singles)
    return {"ttft_mean_s": client, "server_ttft_mean_s": server, "outside_server_ttft_s": client - server}


def make_lanes(args: argparse.Namespace, logs: Path) -> tuple[list[Any], dict[str, str]]:
    lanes: list[Any] = []
    skipped: dict[str, str] = {}
    for name in args.lanes.split(","):
        if name == "in_process":
            lanes.append(InProcessLane())
        elif name == "engine":
            port = free_port()
            argv = decodectl("engine", "--model", MODEL, "--port", str(port), *args.engine_args.split())
            lanes.append(HttpLane(name, ChildServer(name=name, argv=argv, url=f"http://127.0.0.1:{port}",
                                                    log_path=logs / "engine.log"), "/ready"))
        elif name == "vllm":
            if not (args.vllm_python and Path(args.vllm_python).exists() and args.vllm_model
                    and Path(args.vllm_model).is_dir()):
                skipped[name] = (f"no vLLM: --vllm-python {args.vllm_python!r} / --vllm-model {args.vllm_model!r} "
                                 "not found (scripts/vllm_lane.sh makes both)")
                continue
            port = free_port()
            # The server module and the KV flag the operator renders for vLLM's CPU build (operator/engines.py).
            argv = [args.vllm_python, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", args.vllm_model,
                    "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
                    "--max-model-len", "2048", "--kv-cache-memory-bytes", str(1 << 30)]
            lanes.append(HttpLane(name, ChildServer(name=name, argv=argv, url=f"http://127.0.0.1:{port}",
                                                    log_path=logs / "vllm.log", env=VLLM_ENV), "/health"))
        elif name == "llama_cpp":
            binary = args.llama_server or shutil.which("llama-server")
            if binary is None:
                skipped[name] = "no llama-server binary (not on PATH, no --llama-server): llama.cpp is not built here"
                continue
            from decodeservice.engine.loader import ensure_model

            port = free_port()
            argv = [binary, "-m", str(ensure_model(MODEL, progress=False)), "--alias", MODEL, "--host", "127.0.0.1",
                    "--port", str(port), "-t", str(os.cpu_count() or 1), "-np", str(args.streams),
                    "-c", str(args.streams * 1024), "-cb"]
            lanes.append(HttpLane(name, ChildServer(name=name, argv=argv, url=f"http://127.0.0.1:{port}",
                                                    log_path=logs / "llama_cpp.log"), "/health"))
        else:
            raise SystemExit(f"unknown lane {name!r}")
    for variant in args.engine_variant:
        label, _, words = variant.partition("=")
        flags = words.split()
        env = {}  # leading NAME=VALUE words set the server's environment, as in a shell
        while flags and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", flags[0]):
            key, _, value = flags.pop(0).partition("=")
            env[key] = value
        port = free_port()
        argv = decodectl("engine", "--model", MODEL, "--port", str(port), *flags)
        lanes.append(HttpLane(f"engine:{label}", ChildServer(name=label, argv=argv, url=f"http://127.0.0.1:{port}",
                                                             log_path=logs / f"engine_{label}.log", env=env or None),
                              "/ready"))
    return lanes, skipped


# -- the run ----------------------------------------------------------------------------------------
def ratios(lanes: dict[str, dict[str, Any]]) -> dict[str, float]:
    out: dict[str, float] = {}
    keys = ("ttft_s", "decode_tokens_per_s", "streams_output_tokens_per_s", "streams_ttft_p50_s")
    pairs = [("engine", "in_process"), ("engine", "vllm"), ("engine", "llama_cpp"), ("in_process", "vllm")]
    pairs += [(name, den) for name in lanes if name.startswith("engine:") for den in ("engine", "in_process", "vllm")]
    for num, den in pairs:
        if num in lanes and den in lanes:
            for key in keys:
                out[f"{num}/{den} {key}"] = lanes[num][key] / lanes[den][key]
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    body = build_body(args.prompt_tokens)
    report: dict[str, Any] = {
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "load_avg_at_start": os.getloadavg()},
        "env": caps_in_effect(),
        "vllm_env": VLLM_ENV,
        "workload": {"prompt_tokens_target": args.prompt_tokens, "output_tokens": args.output_tokens,
                     "singles": args.singles, "streams": args.streams, "rounds": args.rounds,
                     "engine_args": args.engine_args, "engine_variants": args.engine_variant},
    }
    with tempfile.TemporaryDirectory() as tmp:
        lanes, skipped = make_lanes(args, Path(args.logs or tmp))
        report["skipped"] = skipped
        per_round: list[dict[str, dict[str, Any]]] = []
        try:
            for lane in lanes:
                await lane.start(args.start_timeout_s)
                await lane.run([fresh(body, 8)])  # warm-up: allocations, first-call paths
            report["in_process_engine"] = next((lane.info for lane in lanes if isinstance(lane, InProcessLane)), None)
            for index in range(args.rounds):
                order = lanes[index % len(lanes):] + lanes[:index % len(lanes)]
                results: dict[str, dict[str, Any]] = {}
                for lane in order:
                    settled_s = await settle()
                    load = os.getloadavg()
                    before = await lane.server_ttft()
                    cpu_before = client_cpu_s()
                    singles = [(await lane.run([fresh(body, args.output_tokens)]))[0] for _ in range(args.singles)]
                    cpu_singles = client_cpu_s() - cpu_before
                    split = server_share(singles, before, await lane.server_ttft())
                    cpu_before = client_cpu_s()
                    burst = await lane.run([fresh(body, args.output_tokens) for _ in range(args.streams)])
                    cpu_burst = client_cpu_s() - cpu_before
                    results[lane.name] = {**summarize(singles, burst, args.output_tokens), **split,
                                          **client_cpu(cpu_singles, singles, cpu_burst, burst),
                                          "load_avg_at_start": load, "settled_s": settled_s}
                    print(f"round {index + 1} {lane.name}: {json.dumps(results[lane.name])}", file=sys.stderr)
                per_round.append(results)
        finally:
            for lane in lanes:
                await lane.stop()
    names = list(per_round[0]) if per_round else []
    report["lanes"] = {name: {key: statistics.median(r[name][key] for r in per_round)
                              for key in per_round[0][name]
                              if key not in ("wrong_output_lengths", "load_avg_at_start", "settled_s", "singles_ttft_s")}
                       for name in names}
    report["rounds"] = per_round
    report["ratios"] = ratios(report["lanes"])
    by_round = [ratios(r) for r in per_round]
    report["ratios_by_round"] = {key: [r[key] for r in by_round] for key in report["ratios"]}
    return report


def vllm_lane_paths() -> dict[str, str]:
    script = Path(__file__).resolve().parent.parent / "scripts" / "vllm_lane.sh"
    if not script.exists():
        return {}
    out = subprocess.run(["bash", str(script), "--print-paths"], capture_output=True, text=True, check=False).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--lanes", default="engine,in_process,vllm,llama_cpp")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--singles", type=int, default=3, help="one-at-a-time requests per lane and round")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=490)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--engine-args", default="", help="extra `decodectl engine` flags (default: none)")
    parser.add_argument("--engine-variant", action="append", default=[], metavar="NAME=FLAGS",
                        help="one more engine lane, `engine:NAME`, with these `decodectl engine` flags (leading "
                             "NAME=VALUE words: its environment)")
    lane_paths = vllm_lane_paths()
    parser.add_argument("--vllm-python", default=lane_paths.get("VLLM_PYTHON"),
                        help="default: scripts/vllm_lane.sh --print-paths (the venv it installs vllm-cpu into)")
    parser.add_argument("--vllm-model", default=lane_paths.get("VLLM_MODEL_DIR"),
                        help="the bundled model as a HF folder (default: the one scripts/vllm_lane.sh converts)")
    parser.add_argument("--llama-server", default=None)
    parser.add_argument("--start-timeout-s", type=float, default=600.0)
    parser.add_argument("--logs", help="folder for the servers' logs (default: a temporary one)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    # `timeout` and Ctrl-C end the run through the `finally` that stops every server it started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    report = asyncio.run(run(args))
    emit(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
