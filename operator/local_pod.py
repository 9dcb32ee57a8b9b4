"""A DecodeService's rendered pod, run on this machine as processes (`decodectl up`).

`plan_local_pod` reads the Deployment's pod template exactly as the operator renders it: the init
containers' and containers' commands, args, env and probes. It changes only what a machine without a
kubelet needs: every volume becomes a folder under the work directory (the ConfigMap's files written into
it) and every path a container mounts is mapped there, each container port is a free local one, addresses
bind 127.0.0.1, and `decodectl`/`python` are this interpreter. `run_local_pod` then runs the init
containers in order, starts the containers, waits on their startup and readiness probes as the kubelet
would, and keeps them running until told to stop. Each container runs in its own process group, which
stands for its PID namespace: stopping it sends SIGTERM to its main process, as the kubelet does, and when
that has exited (or the grace period is over) SIGKILL to whatever is left in the group, as a container's
end takes every process in it (vLLM's engine-core and worker processes outlive its API server otherwise).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from decodeservice.engine.loader.registry import CACHE_ENV_VAR, model_cache_dir
from decodeservice.operator.engines import PROXY_PORT
from decodeservice.operator.errors import OperatorError
from decodeservice.operator.manifests import Children

# What a process needs from the machine to start at all; the rest of its environment is the pod's.
_HOST_ENV = ("PATH", "LANG", "LC_ALL", "TZ", "SYSTEMROOT", "VIRTUAL_ENV")


class LocalPodError(OperatorError):
    """A rendered pod that cannot run here as it is (a PVC not mapped, a Secret not given)."""

    reason = "LocalPodUnsupported"


@dataclass(frozen=True, kw_only=True)
class Probe:
    url: str
    period_s: float
    failures: int


@dataclass(frozen=True, kw_only=True)
class LocalProcess:
    name: str
    argv: list[str]
    env: dict[str, str]
    startup: Probe | None = None
    readiness: Probe | None = None


@dataclass(frozen=True, kw_only=True)
class LocalPod:
    init: list[LocalProcess]
    containers: list[LocalProcess]
    url: str  # what the Service would route to: the proxy, or the router in front of it
    ports: dict[int, int] = field(default_factory=dict)  # container port -> local port


def _paths(mounts: list[dict[str, Any]], dirs: Mapping[str, Path]) -> list[tuple[str, str]]:
    pairs = [(str(m["mountPath"]).rstrip("/"), str(dirs[m["name"]])) for m in mounts]
    return sorted(pairs, key=lambda p: -len(p[0]))  # /models/hf before /models


def _rewrite(text: str, *, paths: list[tuple[str, str]], ports: Mapping[int, int]) -> str:
    if paths:
        # A mount path where a path starts: the whole string, after '=', a quote or a space (JSON argv too).
        # One pass, longest mount first, so a local folder is never rewritten again.
        local = dict(paths)
        pattern = "|".join(re.escape(m) for m, _ in paths)
        text = re.sub(rf'(?:^|(?<=[="\s]))({pattern})(?=/|"|$|\s)', lambda m: local[m.group(1)], text)
    for port, local_port in ports.items():
        text = re.sub(rf"^{port}$", str(local_port), text)
        text = text.replace(f"127.0.0.1:{port}", f"127.0.0.1:{local_port}")
    return "127.0.0.1" if text == "0.0.0.0" else text


def _argv(command: list[str]) -> list[str]:
    head, *rest = command
    if head == "decodectl":
        return [sys.executable, "-m", "decodeservice.cli.main", *rest]
    if head in ("python", "python3"):
        return [sys.executable, *rest]
    return command


def _env(container: dict[str, Any], *, rewrite: Callable[[str], str], host: Mapping[str, str]) -> dict[str, str]:
    env = {k: host[k] for k in _HOST_ENV if k in host}
    # The image bakes the bundled models in at DECODESERVICE_MODEL_CACHE; here the local cache stands in.
    env[CACHE_ENV_VAR] = str(model_cache_dir(environ=host))
    if container.get("envFrom"):
        raise LocalPodError(f"container {container['name']}: envFrom (Secrets, ConfigMaps) cannot be read here")
    for var in container.get("env") or []:
        name = var["name"]
        if "value" in var:
            env[name] = rewrite(str(var["value"]))
        elif name in host:  # a Secret's or ConfigMap's key: the caller's environment stands in for it
            env[name] = host[name]
        else:
            raise LocalPodError(f"container {container['name']}: {name} comes from the cluster "
                                f"({', '.join(var.get('valueFrom') or {})}); set {name} in the environment")
    return env


def _probe(spec: dict[str, Any] | None, ports: Mapping[str, int]) -> Probe | None:
    if not spec or "httpGet" not in spec:
        return None
    get = spec["httpGet"]
    port = ports[get["port"]] if isinstance(get["port"], str) else int(get["port"])
    return Probe(url=f"http://127.0.0.1:{port}{get['path']}", period_s=float(spec.get("periodSeconds", 10)),
                 failures=int(spec.get("failureThreshold", 3)))


def _local_router(children: Children, *, endpoint: str, port: int, policy_dir: Path,
                  host: Mapping[str, str]) -> LocalProcess:
    """The router as rendered, routing to the one local pod: its `--service` (an EndpointSlice watch, which
    needs a cluster) becomes `--endpoints`, as `decodectl router` takes for local runs."""
    assert children.router is not None
    (c,) = children.router.deployment["spec"]["template"]["spec"]["containers"]
    args, argv = list(c["args"]), []
    cluster_only = {"--service", "--namespace", "--endpoint-port"}
    while args:
        flag = args.pop(0)
        value = args.pop(0) if flag.startswith("--") and args and not args[0].startswith("--") else None
        if flag in cluster_only:
            continue
        if flag == "--port":
            value = str(port)
        elif flag == "--host":
            value = "127.0.0.1"
        elif flag == "--policy":
            value = str(policy_dir / "policy.yaml")
        argv += [flag] if value is None else [flag, value]
    argv += ["--endpoints", endpoint]
    env = {k: host[k] for k in _HOST_ENV if k in host}
    env["HOME"] = str(policy_dir.parent / "router-home")
    readiness = _probe(c.get("readinessProbe"), {"http": port})
    return LocalProcess(name="router", argv=_argv([*c["command"], *argv]), env=env, readiness=readiness)


def plan_local_pod(children: Children, *, workdir: Path, ports: Mapping[int, int],
                   volumes: Mapping[str, Path] | None = None, host_env: Mapping[str, str] | None = None,
                   router_port: int | None = None) -> LocalPod:
    """The pod of `children` as local processes; `ports` maps each container port to a local one. With
    routing mode router and `router_port`, the router runs too, in front of the pod, on that port."""
    if children.workload["kind"] != "Deployment":
        raise LocalPodError("a multi-node service (resources.nodes > 1) runs as a LeaderWorkerSet of several "
                            "GPU pods; decodectl up runs single-node services only")
    pod = children.deployment["spec"]["template"]["spec"]
    host = dict(os.environ if host_env is None else host_env)
    given = dict(volumes or {})
    dirs: dict[str, Path] = {}
    for volume in pod.get("volumes") or []:
        name = volume["name"]
        if name in given:
            dirs[name] = given[name]
        elif "persistentVolumeClaim" in volume:
            raise LocalPodError(f"volume {name} is the claim {volume['persistentVolumeClaim']['claimName']}: give "
                                f"a local folder for it with --volume {name}=PATH")
        else:
            dirs[name] = workdir / "volumes" / name
            dirs[name].mkdir(parents=True, exist_ok=True)
        if "configMap" in volume and name not in given:
            for key, text in children.config_map["data"].items():
                (dirs[name] / key).write_text(text, encoding="utf-8")
    missing = set(ports) ^ {p["containerPort"] for c in pod["containers"] for p in c.get("ports") or []}
    if missing:
        raise ValueError(f"ports must map exactly the container ports, not {sorted(missing)}")

    def process(c: dict[str, Any]) -> LocalProcess:
        paths = _paths(c.get("volumeMounts") or [], dirs)

        def rewrite(text: str) -> str:
            return _rewrite(text, paths=paths, ports=ports)

        named = {p["name"]: ports[p["containerPort"]] for p in c.get("ports") or [] if "name" in p}
        # Pod paths are rewritten in what the pod renders, before the local interpreter stands in for
        # `decodectl`: this machine's own paths (a checkout under /tmp) are not the pod's mounts.
        return LocalProcess(name=c["name"], argv=_argv([rewrite(a) for a in [*c["command"], *(c.get("args") or [])]]),
                            env=_env(c, rewrite=rewrite, host=host),
                            startup=_probe(c.get("startupProbe"), named), readiness=_probe(c.get("readinessProbe"), named))

    containers = [process(c) for c in pod["containers"]]
    url = f"http://127.0.0.1:{ports[PROXY_PORT]}"
    if children.router is not None and router_port is not None:
        containers.append(_local_router(children, endpoint=url, port=router_port, policy_dir=dirs["policy"],
                                        host=host))
        url = f"http://127.0.0.1:{router_port}"
    return LocalPod(init=[process(c) for c in pod.get("initContainers") or []], containers=containers,
                    url=url, ports=dict(ports))


def _wait_ready(proc: LocalProcess, popen: subprocess.Popen[bytes], stop: threading.Event, *,
                deadline: float) -> bool:
    """The kubelet's order: the startup probe, then the readiness probe. A kubelet waits on readiness for
    ever (the pod just stays unready); here both share the pod's start-up budget."""
    for probe in (proc.startup, proc.readiness):
        if probe is None:
            continue
        with httpx.Client(timeout=2.0) as client:
            while True:
                if popen.poll() is not None:
                    raise LocalPodError(f"container {proc.name} exited ({popen.returncode}) before it was ready")
                try:
                    if client.get(probe.url).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise LocalPodError(f"container {proc.name}: {probe.url} did not pass within its probe's budget")
                if stop.wait(min(0.25, probe.period_s)):
                    return False
    return True


def start_container(proc: LocalProcess, *, cwd: Path | None = None) -> subprocess.Popen[bytes]:
    """The container's main process, leading a process group of its own (its stand-in PID namespace)."""
    return subprocess.Popen(proc.argv, env=proc.env, cwd=cwd, start_new_session=True)


def stop_containers(running: list[subprocess.Popen[bytes]], *, grace_s: float) -> None:
    """SIGTERM each main process, as the kubelet sends it; each drains within the grace period. Then SIGKILL
    each group: what a main process leaves behind ends with its container."""
    for popen in running:
        if popen.poll() is None:
            popen.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for popen in running:
        try:
            popen.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for popen in running:
        try:
            os.killpg(popen.pid, signal.SIGKILL)  # start_new_session: the group id is the main process's pid
        except (ProcessLookupError, PermissionError):
            pass  # the group is empty already
        popen.wait()


def living_in_group(pgid: int) -> list[int]:
    """The pids in process group `pgid` that have not exited (zombies left unreaped by pid 1 do not count);
    Linux's /proc only, empty elsewhere."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text(encoding="ascii", errors="replace").rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited while listed
        if fields[0] != "Z" and int(fields[2]) == pgid:
            pids.append(int(stat.parent.name))
    return pids


def run_local_pod(pod: LocalPod, *, stop: threading.Event, on_ready: Callable[[LocalPod], None],
                  grace_s: float = 30.0) -> int:
    """Init containers in order, then the containers until `stop` is set or one exits; 0 on a clean stop."""
    for init in pod.init:
        if subprocess.run(init.argv, env=init.env, check=False).returncode != 0:
            raise LocalPodError(f"init container {init.name} failed")
    running: list[tuple[LocalProcess, subprocess.Popen[bytes]]] = []
    try:
        for proc in pod.containers:
            running.append((proc, start_container(proc)))
        budget = max([p.period_s * p.failures for p in (c.startup or c.readiness for c in pod.containers) if p]
                     or [60.0])
        deadline = time.monotonic() + budget
        if not all(_wait_ready(proc, popen, stop, deadline=deadline) for proc, popen in running):
            return 0
        on_ready(pod)
        while not stop.wait(0.5):
            for proc, popen in running:
                if popen.poll() is not None:
                    raise LocalPodError(f"container {proc.name} exited ({popen.returncode})")
        return 0
    finally:
        stop_containers([popen for _, popen in running], grace_s=grace_s)
