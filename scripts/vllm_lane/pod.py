"""Run examples/vllm-proxy.yaml's pod here, as the operator renders it for CPU, in front of a real vLLM.

    .venv/bin/python -P scripts/vllm_lane/pod.py --vllm-python VENV/bin/python --model-dir DIR --workdir DIR \\
        --state FILE -- <command run once the pod is ready>

The manifest is rendered by the operator's own `render` and planned by `decodectl up`'s `plan_local_pod`
(every command, argument, environment variable and probe as rendered), with these overrides, each for a
reason: `resources` for this machine (gpus 0, so vLLM's CPU build and its `--kv-cache-memory-bytes`;
2 CPUs, 4Gi), the model as a pvc:// folder (the HF folder converted from the bundled GGUF; there is no
network here), `outputLength` lowered (so a clamp is cheap to see), and `--api-key` added to extraArgs
(so the key's paths are tested). `decodectl up` runs `python3` as its own interpreter; here the engine
container's `python3` is the vLLM venv's instead (the image's interpreter), and every process runs in the
work directory, as a container runs in its image's, not in this checkout.

While the pod starts, the proxy's /ready and the engine's port are polled and written to --state (JSON),
with the URLs, the engine's pid and the API key; the command then runs with VLLM_LANE_STATE pointing at
it. The pod is stopped when the command ends as `decodectl up` stops it (SIGTERM to each container's main
process, as the kubelet sends it, then SIGKILL to what is left of its process group, as the container's end
takes it); a process of the pod still alive after that fails the run. The exit status is the command's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from decodeservice.operator.engines import ENGINE_PORT, PROXY_PORT
from decodeservice.operator.local_pod import (
    LocalProcess,
    living_in_group,
    plan_local_pod,
    start_container,
    stop_containers,
)
from decodeservice.operator.manifests import render

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "vllm-proxy.yaml"
API_KEY = "vllm-lane-key"
CAP = {"maxOutputTokens": 8, "defaultMaxTokens": 4}
STARTUP_S = 900.0


def manifest(model_dir: Path) -> dict[str, Any]:
    body = yaml.safe_load(EXAMPLE.read_text(encoding="utf-8"))
    spec = body["spec"]
    spec["model"] = {"uri": f"pvc://lane/{model_dir.name}", "servedName": spec["model"]["servedName"]}
    spec["resources"] = {"gpus": 0, "cpu": "2", "memory": "4Gi"}
    spec["engine"]["extraArgs"] = [*spec["engine"].get("extraArgs", []), "--api-key", API_KEY]
    spec["engine"].pop("gpuMemoryFraction", None)  # a GPU setting: refused with gpus 0
    spec["engine"].pop("image", None)  # the default for gpus 0 (vLLM's CPU build); unused here
    spec["policies"]["outputLength"] = {**spec["policies"].get("outputLength", {}), **CAP}
    return body


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--vllm-python", type=Path, required=True)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--state", type=Path, required=True)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    args.workdir.mkdir(parents=True, exist_ok=True)
    ports = {PROXY_PORT: _free_port(), ENGINE_PORT: _free_port()}
    pod = plan_local_pod(render(manifest(args.model_dir)), workdir=args.workdir, ports=ports,
                         volumes={"model-pvc": args.model_dir.parent})
    if pod.init:
        raise SystemExit(f"unexpected init containers for a pvc:// model: {[p.name for p in pod.init]}")
    byname = {p.name: p for p in pod.containers}
    engine = byname["engine"]
    engine = dataclasses.replace(engine, argv=[str(args.vllm_python), *engine.argv[1:]])  # the image's python3
    print("engine:", " ".join(engine.argv), flush=True)
    state: dict[str, Any] = {"proxy_url": pod.url, "engine_url": f"http://127.0.0.1:{ports[ENGINE_PORT]}",
                             "api_key": API_KEY, "engine_argv": engine.argv, "startup": []}
    procs: list[tuple[LocalProcess, subprocess.Popen[bytes]]] = []
    try:
        for proc in (engine, byname["proxy"]):
            procs.append((proc, start_container(proc, cwd=args.workdir)))
        state["engine_pid"] = procs[0][1].pid
        started = time.monotonic()
        with httpx.Client(timeout=2.0) as client:
            while True:  # the proxy's /ready as the kubelet's readiness probe sees it, beside the engine's port
                for proc, popen in procs:
                    if popen.poll() is not None:
                        raise SystemExit(f"{proc.name} exited ({popen.returncode}) before the pod was ready")
                try:
                    status = client.get(pod.url + "/ready").status_code
                except httpx.TransportError:
                    status = None
                state["startup"].append({"t": round(time.monotonic() - started, 2), "proxy_ready": status,
                                         "engine_listening": _listening(ports[ENGINE_PORT])})
                if status == 200:
                    break
                if time.monotonic() - started > STARTUP_S:
                    raise SystemExit(f"the pod was not ready within {STARTUP_S:.0f} s")
                time.sleep(1.0)
        state["ready_after_s"] = round(time.monotonic() - started, 1)
        print(f"ready after {state['ready_after_s']} s: {pod.url}", flush=True)
        args.state.write_text(json.dumps(state, indent=1), encoding="utf-8")
        returncode = subprocess.run(command, env={**os.environ, "VLLM_LANE_STATE": str(args.state)},
                                    check=False).returncode
    finally:
        stop_containers([popen for _, popen in procs], grace_s=30.0)
    # Signals are delivered before this looks, but a process dies on its next scheduling: give it a moment.
    deadline = time.monotonic() + 10.0
    while left := {proc.name: pids for proc, popen in procs if (pids := living_in_group(popen.pid))}:
        if time.monotonic() > deadline:
            print(f"processes of the pod outlived it: {left}", file=sys.stderr, flush=True)
            return 1
        time.sleep(0.2)
    return returncode


if __name__ == "__main__":
    sys.exit(main())
