"""`decodectl up`: what the operator renders for the builtin engine starts, becomes Ready through its own
probes and serves, as local processes."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from decodeservice.operator.local_pod import (
    LocalPod,
    LocalPodError,
    LocalProcess,
    living_in_group,
    plan_local_pod,
    run_local_pod,
)
from decodeservice.operator.manifests import render
from tests.operator.helpers import EXAMPLES, load


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_the_plan_is_the_rendered_pod_with_local_paths_and_ports(tmp_path: Path) -> None:
    children = render(load(EXAMPLES / "cpu-smoke.yaml"))
    pod = plan_local_pod(children, workdir=tmp_path, ports={8000: 18000, 8001: 18001}, host_env={"PATH": "/bin"})
    engine, proxy = pod.containers
    rendered = {c["name"]: c for c in children.deployment["spec"]["template"]["spec"]["containers"]}
    assert engine.argv[:3] == [sys.executable, "-m", "decodeservice.cli.main"]
    assert len(engine.argv) == 2 + len(rendered["engine"]["command"]) + len(rendered["engine"]["args"])
    assert engine.argv[engine.argv.index("--port") + 1] == "18001" and "0.0.0.0" not in engine.argv
    assert engine.argv[engine.argv.index("--max-num-seqs") + 1] == "8"  # the spec's, as rendered
    assert proxy.argv[proxy.argv.index("--upstream") + 1] == "http://127.0.0.1:18001"
    policy = Path(proxy.argv[proxy.argv.index("--policy") + 1])
    assert policy == tmp_path / "volumes" / "policy" / "policy.yaml"
    assert policy.read_text() == children.config_map["data"]["policy.yaml"]
    assert engine.env["HOME"] == str(tmp_path / "volumes" / "tmp")
    assert engine.env["HF_HOME"] == str(tmp_path / "volumes" / "cache" / "huggingface")
    assert engine.startup is not None and engine.startup.url == "http://127.0.0.1:18001/health"
    assert engine.readiness is not None and engine.readiness.url == "http://127.0.0.1:18001/ready"
    assert proxy.readiness is not None and proxy.readiness.url == "http://127.0.0.1:18000/ready"


def test_a_download_runs_as_its_init_container_with_local_paths(tmp_path: Path) -> None:
    body = load(EXAMPLES / "cpu-smoke.yaml")
    body["spec"]["model"] = {"uri": "hf://org/m@abc", "tokenSecret": {"name": "hf"}}
    children = render(body)
    with pytest.raises(LocalPodError, match="set HF_TOKEN in the environment"):
        plan_local_pod(children, workdir=tmp_path, ports={8000: 1, 8001: 2}, host_env={})
    pod = plan_local_pod(children, workdir=tmp_path, ports={8000: 1, 8001: 2}, host_env={"HF_TOKEN": "t"})
    (fetch,) = pod.init
    check, download = json.loads(fetch.argv[-1])  # the builtin engine's config.json check, then the snapshot
    local = str(tmp_path / "volumes" / "model-cache" / "org--m@abc")
    assert check[5] == download[5] == local and fetch.env["HF_TOKEN"] == "t"
    body["spec"]["model"]["cache"] = {"claimName": "shared"}
    with pytest.raises(LocalPodError, match="--volume model-cache=PATH"):
        plan_local_pod(render(body), workdir=tmp_path, ports={8000: 1, 8001: 2}, host_env={"HF_TOKEN": "t"})


# A container whose main process starts a helper of its own (as vLLM's API server starts its engine core),
# drains on SIGTERM and exits, leaving the helper running.
_FORKING_CONTAINER = """
import pathlib, signal, subprocess, sys
out = pathlib.Path(sys.argv[1])
helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
(out / "helper.pid").write_text(str(helper.pid))
def drain(*_):
    (out / "drained").write_text("yes")
    sys.exit(0)
signal.signal(signal.SIGTERM, drain)
signal.pause()
"""


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process groups from Linux's /proc")
def test_a_stopped_pod_leaves_no_process_behind(tmp_path: Path) -> None:
    container = LocalProcess(name="engine", argv=[sys.executable, "-c", _FORKING_CONTAINER, str(tmp_path)], env={})
    stop, seen = threading.Event(), {}

    def on_ready(_: LocalPod) -> None:
        deadline = time.monotonic() + 30
        while not (tmp_path / "helper.pid").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        seen["helper"] = int((tmp_path / "helper.pid").read_text())
        seen["group"] = living_in_group(_group_of(seen["helper"]))
        stop.set()

    assert run_local_pod(LocalPod(init=[], containers=[container], url=""), stop=stop, on_ready=on_ready,
                         grace_s=10) == 0
    assert seen["helper"] in seen["group"], seen  # the helper was in the container's group while it ran
    assert (tmp_path / "drained").read_text() == "yes"  # SIGTERM first: the main process drained
    deadline = time.monotonic() + 5
    while _alive(seen["helper"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(seen["helper"]), "the container's helper outlived its pod"


def _group_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[2])


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_decodectl_up_serves_the_cpu_smoke_example(tmp_path: Path) -> None:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-P", "-m", "decodeservice.cli.main", "up", "-f",
                             str(EXAMPLES / "cpu-smoke.yaml"), "--port", str(port), "--workdir", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ready, lines = threading.Event(), []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("ready: "):
                ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert ready.wait(timeout=300), "".join(lines[-30:])
        # Greedy, and the count checked against the finish reason: at the default temperature the model
        # once sampled its end-of-turn token third (CI: 3 tokens where 4 were asked), a valid answer.
        body = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                "temperature": 0}
        response = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        answer = response.json()
        used, finish = answer["usage"]["completion_tokens"], answer["choices"][0]["finish_reason"]
        assert (finish, used) == ("length", 4) or (finish == "stop" and 1 <= used < 4), answer
        assert answer["choices"][0]["message"]["content"], answer
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=90)
        reader.join(timeout=10)
        assert proc.stdout is not None
        proc.stdout.close()
    assert code == 0, "".join(lines[-30:])


def test_a_routed_service_runs_the_rendered_router_in_front_of_the_pod(tmp_path: Path) -> None:
    children = render(load(EXAMPLES / "scale-to-zero.yaml"))
    proxy_port, router_port = _free_port(), _free_port()
    pod = plan_local_pod(children, workdir=tmp_path, ports={8000: proxy_port, 8001: _free_port()},
                         router_port=router_port)
    engine, proxy, router = pod.containers
    assert pod.url == f"http://127.0.0.1:{router_port}"
    argv = router.argv[router.argv.index("router"):]
    # The rendered command line, with the EndpointSlice watch (cluster-only) replaced by the local pod.
    assert argv == ["router", "--host", "127.0.0.1", "--port", str(router_port),
                    "--policy", str(tmp_path / "volumes" / "policy" / "policy.yaml"),
                    "--hold-seconds", "60", "--max-held", "256", "--endpoints", f"http://127.0.0.1:{proxy_port}"]
    assert router.readiness is not None
    ready_url = router.readiness.url
    assert ready_url == f"http://127.0.0.1:{router_port}/ready"
    # The real `decodectl router` takes that command line: ready with no pod up (it would hold requests).
    proc = subprocess.Popen(router.argv, env=router.env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        ready = threading.Event()

        def probe() -> None:
            with httpx.Client(timeout=2.0) as client:
                while proc.poll() is None and not ready.is_set():
                    try:
                        if client.get(ready_url).status_code == 200:
                            ready.set()
                    except httpx.TransportError:
                        ready.wait(0.1)  # not listening yet: look again shortly

        threading.Thread(target=probe, daemon=True).start()
        ready.wait(timeout=60)
        assert ready.is_set(), proc.stderr.read().decode() if proc.poll() is not None and proc.stderr else "no /ready"
        with httpx.Client(timeout=5.0) as client:
            metrics = client.get(f"{pod.url}/metrics").text
        assert "decode_router:requests_held" in metrics and "decode_router:last_request_timestamp_seconds" in metrics
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()
