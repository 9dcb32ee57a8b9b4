"""resources.nodes > 1: a LeaderWorkerSet of vLLM pods joined by Ray, instead of the Deployment.

The rendered LWS is checked against the upstream CRD (vendored in tests/operator/schemas/, see its
README) and its pod templates with kubernetes-validate; the Ray scripts are run for real against
stand-ins for `ray` and vLLM; the operator is run against the emulator with and without the LWS API.

What only a cluster with GPUs and LWS can check: that the LWS controller and webhook accept the object
(its webhook's rules beyond the schema), that the pods find each other (LWS_LEADER_ADDRESS through the
per-replica headless Services), and that vLLM shards the model over Ray as the flags say.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from aiohttp import web
from kmock import action

from decodeservice.operator.autoscaler.controller import AutoscalingConfig
from decodeservice.operator.autoscaler.scrape import ScrapeSettings
from decodeservice.operator.engines import RAY_LEADER_SCRIPT, RAY_PORT, RAY_WORKER_SCRIPT
from decodeservice.operator.errors import InvalidSpecError
from decodeservice.operator.leader_worker_set import LEADER, ROLE_LABEL, WORKER
from decodeservice.operator.local_pod import LocalPodError, plan_local_pod
from decodeservice.operator.manifests import Children, build_children, render, selector_labels
from decodeservice.operator.spec import validate_spec
from tests.operator.conftest import Cluster, run_operator
from tests.operator.helpers import EXAMPLES, as_pod_templates, load, operator_roles, pod_templates
from tests.operator.schema import structural_errors
from tests.operator.security import restricted_violations
from tests.operator.test_autoscaler_e2e import INTERVAL, Fleet, Pod
from tests.operator.test_operator_e2e import DS_PATH, condition, owned_by
from tests.support.kube_emulator import DEPLOYMENTS, DS, LWS, SERVICES, serve_leader_worker_sets

SCHEMA_PATH = Path(__file__).parent / "schemas" / "leaderworkerset.x-k8s.io_leaderworkersets.yaml"
K8S_VERSION = "1.30"
EXAMPLE = EXAMPLES / "vllm-multinode.yaml"


def upstream_schema() -> dict[str, Any]:
    crd = yaml.load(SCHEMA_PATH.read_text(), Loader=yaml.CSafeLoader)  # 1.3 MB: libyaml's loader
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    schema = version["schema"]["openAPIV3Schema"]
    assert isinstance(schema, dict)
    return schema


def pruned(schema: dict[str, Any], obj: Any, path: str = "") -> list[str]:
    """Fields the API server would drop silently: not declared by a structural schema, which JSON schema
    (no additionalProperties: false) lets pass."""
    if isinstance(obj, list):
        return [p for i, item in enumerate(obj) for p in pruned(schema.get("items") or {}, item, f"{path}[{i}]")]
    if not isinstance(obj, dict) or schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    props, extra = schema.get("properties") or {}, schema.get("additionalProperties")
    out = []
    for key, value in obj.items():
        if key in props:
            out += pruned(props[key], value, f"{path}.{key}")
        elif isinstance(extra, dict):
            out += pruned(extra, value, f"{path}.{key}")
        elif extra is not True:
            out.append(f"{path}.{key}")
    return out


def lws_errors(lws: dict[str, Any]) -> list[str]:
    schema = upstream_schema()
    _, errors = structural_errors(schema, lws)
    body = {k: v for k, v in lws.items() if k != "metadata"}  # the root metadata is ObjectMeta, never pruned
    return errors + [f"{p}: would be pruned" for p in pruned(schema, body)]


def multinode(**spec: Any) -> dict[str, Any]:
    body = copy.deepcopy(load(EXAMPLE))
    body["metadata"]["name"] = "big"
    for key, value in spec.items():
        body["spec"][key] = {**body["spec"].get(key, {}), **value} if isinstance(value, dict) else value
    return body


def templates(children: Children) -> tuple[dict[str, Any], dict[str, Any]]:
    leader, worker = pod_templates(children.workload)
    return leader, worker


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


# --- manifests ------------------------------------------------------------------------------------------

def test_the_rendered_lws_validates_against_the_upstream_crd() -> None:
    children = render(load(EXAMPLE))
    lws = children.workload
    assert (lws["apiVersion"], lws["kind"]) == ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet")
    assert [o["kind"] for o in children.all()] == ["ConfigMap", "Service", "LeaderWorkerSet"]
    assert lws_errors(lws) == []
    spec = lws["spec"]
    assert spec["replicas"] == 1 and spec["leaderWorkerTemplate"]["size"] == 2
    assert spec["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
    # Our Service owns the LWS's name, so the headless Services are per replica (NAME-0, ...).
    assert spec["networkConfig"] == {"subdomainPolicy": "UniquePerReplica"}
    assert spec["rolloutStrategy"] == {"type": "RollingUpdate",
                                       "rollingUpdateConfiguration": {"maxSurge": 0, "maxUnavailable": 1}}
    with pytest.raises(ValueError, match="not a Deployment"):
        children.deployment  # noqa: B018 (the property raises)


def test_the_checker_rejects_what_the_api_server_would() -> None:
    good = render(load(EXAMPLE)).workload
    broken = {
        "size as text": lambda s: s["leaderWorkerTemplate"].update(size="two"),
        "unknown restart policy": lambda s: s["leaderWorkerTemplate"].update(restartPolicy="Always"),
        "unknown subdomain policy": lambda s: s.update(networkConfig={"subdomainPolicy": "Private"}),
        "no worker template": lambda s: s["leaderWorkerTemplate"].pop("workerTemplate"),
        "a field the schema lacks (pruned)": lambda s: s["leaderWorkerTemplate"].update(leaderCount=1),
        "a container field the schema lacks": lambda s: s["leaderWorkerTemplate"]["workerTemplate"]["spec"][
            "containers"][0].update(gpus=8),
        "negative replicas": lambda s: s.update(replicas=-1),
    }
    for what, change in broken.items():
        lws = copy.deepcopy(good)
        change(lws["spec"])
        assert lws_errors(lws), what


def test_the_pod_templates_are_valid_secure_pods() -> None:
    children = render(load(EXAMPLE))
    for template in as_pod_templates(children.workload):
        kubernetes_validate.validate(template, K8S_VERSION, strict=True)
    assert restricted_violations(children.workload) == []
    with pytest.raises(Exception, match="gpus"):  # the validation bites: a bad template is refused
        bad = copy.deepcopy(as_pod_templates(children.workload)[1])
        bad["template"]["spec"]["containers"][0]["gpus"] = 8
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_the_leader_serves_vllm_over_ray_and_the_workers_join_it() -> None:
    leader, worker = templates(render(load(EXAMPLE)))
    lspec, wspec = leader["spec"], worker["spec"]
    assert [c["name"] for c in lspec["containers"]] == ["engine", "proxy"]
    assert [c["name"] for c in wspec["containers"]] == ["engine"]  # no proxy on a worker
    engine, work = lspec["containers"][0], wspec["containers"][0]
    # The leader: the Ray head, then vLLM with tensor parallel per pod and pipeline parallel across them.
    assert engine["command"] == ["sh", "-c", RAY_LEADER_SCRIPT, "vllm-leader"]
    assert f"ray start --head --port={RAY_PORT}" in RAY_LEADER_SCRIPT
    assert 'exec python3 -m vllm.entrypoints.launchers.api_server.entry "$@"' in RAY_LEADER_SCRIPT
    args = engine["args"]
    assert flag(args, "--tensor-parallel-size") == "8" and flag(args, "--pipeline-parallel-size") == "2"
    assert flag(args, "--distributed-executor-backend") == "ray"
    assert flag(args, "--port") == "8001" and "--max-model-len" in args
    # A worker: joins the leader's head (the kubelet expands the address the LWS controller sets).
    assert work["command"] == ["sh", "-c", RAY_WORKER_SCRIPT, "ray-worker"]
    assert work["args"] == [f"$(LWS_LEADER_ADDRESS):{RAY_PORT}"]
    assert "ray start --address=\"$1\" --block" in RAY_WORKER_SCRIPT
    assert not {"ports", "readinessProbe", "livenessProbe", "startupProbe"} & set(work)
    # Same image, GPUs, memory, env and model mounts on every pod: each loads its shard from the same path.
    for key in ("image", "resources", "env", "volumeMounts", "securityContext"):
        assert work[key] == engine[key], key
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert [c["name"] for c in wspec["initContainers"]] == [c["name"] for c in lspec["initContainers"]] == [
        "fetch-model"]
    assert {v["name"] for v in lspec["volumes"]} - {v["name"] for v in wspec["volumes"]} == {"policy"}
    # Only the leader is scraped (the proxy's /metrics); both carry the service's labels and a role.
    assert "prometheus.io/scrape" in leader["metadata"]["annotations"]
    assert "prometheus.io/scrape" not in worker["metadata"].get("annotations", {})
    assert leader["metadata"]["labels"][ROLE_LABEL] == LEADER and worker["metadata"]["labels"][ROLE_LABEL] == WORKER


def test_the_service_the_pool_and_status_select_leaders_only() -> None:
    body = multinode(replicas=3, routing={"inferencePool": {"enabled": True, "endpointPickerRef": {
        "name": "epp", "port": {"number": 9002}}}})
    children = render(body)
    leader, worker = templates(children)
    selector = children.service["spec"]["selector"]
    assert selector == {**selector_labels("big"), ROLE_LABEL: LEADER}
    assert selector.items() <= leader["metadata"]["labels"].items()
    assert not selector.items() <= worker["metadata"]["labels"].items()
    assert children.inference_pool is not None
    assert children.inference_pool["spec"]["selector"]["matchLabels"] == selector
    # The budget covers every pod of the service: a drain takes one pod, so one group, at a time.
    assert children.pdb is not None and children.pdb["spec"]["selector"]["matchLabels"] == selector_labels("big")
    assert selector_labels("big").items() <= worker["metadata"]["labels"].items()


def test_one_node_is_the_deployment_as_before() -> None:
    body = multinode(resources={"nodes": 1})
    children = render(body)
    assert children.workload["kind"] == "Deployment"
    args = children.deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert flag(args, "--tensor-parallel-size") == "8" and "--pipeline-parallel-size" not in args
    assert "--distributed-executor-backend" not in args
    assert children.service["spec"]["selector"] == selector_labels("big")


def test_decodectl_up_refuses_a_multi_node_service(tmp_path: Path) -> None:
    with pytest.raises(LocalPodError, match="single-node services only"):
        plan_local_pod(render(load(EXAMPLE)), workdir=tmp_path, ports={8000: 18000, 8001: 18001})


def test_multinode_needs_vllm_and_a_short_name() -> None:
    builtin = {"model": {"uri": "bundled://smollm2-135m"}, "resources": {"nodes": 2}}
    with pytest.raises(InvalidSpecError, match="multi-node serving .* needs engine.kind: vllm"):
        validate_spec(builtin)
    with pytest.raises(InvalidSpecError, match="greater than or equal to 1"):
        validate_spec({"model": {"uri": "bundled://smollm2-135m"}, "resources": {"nodes": 0}})
    v = validate_spec(multinode()["spec"])
    build_children(name="n" * 47, namespace="ml", v=v)
    with pytest.raises(InvalidSpecError, match="too long for a multi-node service"):
        build_children(name="n" * 48, namespace="ml", v=v)


@pytest.mark.parametrize("values", [None, {"watchNamespaces": ["team-a"]}], ids=["cluster-wide", "namespaced"])
def test_chart_rbac_grants_what_the_lws_needs(values: dict[str, Any] | None) -> None:
    roles = operator_roles(values)
    assert roles
    for role in roles:  # apply (create + patch), read (ownership, replicas), delete (back to one node)
        rules = [r for r in role["rules"] if "leaderworkerset.x-k8s.io" in r["apiGroups"]]
        assert rules == [{"apiGroups": ["leaderworkerset.x-k8s.io"], "resources": ["leaderworkersets"],
                          "verbs": ["get", "create", "patch", "delete"]}]


# --- the Ray scripts, run ---------------------------------------------------------------------------------

FAKE_RAY_MODULE = """
import os, time
time.sleep = lambda seconds: None  # the wait loop's 5 s pauses, in the stand-in's process only
def init(**kwargs):
    pass
def nodes():
    with open(os.environ["FAKE_RAY_STATE"]) as f:
        joined = int(f.read() or 0) + 1
    with open(os.environ["FAKE_RAY_STATE"], "w") as f:
        f.write(str(joined))
    return [{"Alive": True}] * min(joined, 2) + [{"Alive": False}]
"""
FAKE_VLLM = "import json, sys\nprint('VLLM ' + json.dumps(sys.argv[1:]))\n"


def _stand_ins(tmp_path: Path, *, ray_failures: int = 0) -> dict[str, str]:
    """`ray`, `sleep` and `python3` on PATH, and importable `ray` and `vllm` stand-ins that log what ran."""
    bin_dir, lib = tmp_path / "bin", tmp_path / "lib"
    server = lib / "vllm" / "entrypoints" / "launchers" / "api_server"  # the module engines.VLLM_SERVER runs
    server.mkdir(parents=True)
    bin_dir.mkdir()
    for pkg in ("vllm", "vllm/entrypoints", "vllm/entrypoints/launchers", "vllm/entrypoints/launchers/api_server"):
        (lib / pkg / "__init__.py").write_text("")
    (server / "entry.py").write_text(FAKE_VLLM)
    (lib / "ray.py").write_text(FAKE_RAY_MODULE)
    log = tmp_path / "ray.log"
    (bin_dir / "ray").write_text(textwrap.dedent(f"""\
        #!/bin/sh
        echo "ray $*" >> {log}
        n=$(grep -c . {log})
        [ "$n" -gt {ray_failures} ]
        """))
    (bin_dir / "sleep").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "python3").symlink_to(sys.executable)
    for tool in ("ray", "sleep"):
        (bin_dir / tool).chmod(0o755)
    (tmp_path / "state").write_text("0")
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": str(lib), "FAKE_RAY_STATE": str(tmp_path / "state"),
            "LWS_GROUP_SIZE": "2", "RAY_LOG": str(log)}


def test_the_leader_script_starts_the_head_waits_for_the_group_then_serves(tmp_path: Path) -> None:
    env = _stand_ins(tmp_path)
    engine = templates(render(load(EXAMPLE)))[0]["spec"]["containers"][0]
    args = [*engine["args"], "--chat-template", "{{ 'a b' }} \"$HOME\""]  # no shell expansion of spec text
    run = subprocess.run([*engine["command"], *args], env=env, capture_output=True, text=True, timeout=60,
                         check=False)
    assert run.returncode == 0, run.stderr
    assert Path(env["RAY_LOG"]).read_text() == (f"ray start --head --port={RAY_PORT} --disable-usage-stats "
                                                f"--object-store-memory={1 << 30}\n")
    # ray.nodes() was asked until both pods of the group were alive: one wait, then vLLM.
    assert "1/2 Ray nodes joined; waiting" in run.stdout
    served = [line for line in run.stdout.splitlines() if line.startswith("VLLM ")]
    assert served == ["VLLM " + json.dumps(args)]


def test_the_leader_gives_up_when_its_group_does_not_gather(tmp_path: Path) -> None:
    env = {**_stand_ins(tmp_path), "LWS_GROUP_SIZE": "3"}  # the stand-in never has more than 2 alive
    script = RAY_LEADER_SCRIPT.replace(" 900\n", " 0.5\n")
    assert script != RAY_LEADER_SCRIPT
    run = subprocess.run(["sh", "-c", script, "vllm-leader", "--model", "m"], env=env, capture_output=True,
                         text=True, timeout=60, check=False)
    assert run.returncode != 0 and "Ray nodes joined in time" in run.stderr
    assert "VLLM" not in run.stdout


def test_the_worker_script_retries_until_the_head_answers(tmp_path: Path) -> None:
    env = _stand_ins(tmp_path, ray_failures=2)
    worker = templates(render(load(EXAMPLE)))[1]["spec"]["containers"][0]
    address = f"big-0.big-0.default:{RAY_PORT}"  # what the kubelet makes of $(LWS_LEADER_ADDRESS):6379
    run = subprocess.run([*worker["command"], address], env=env, capture_output=True, text=True, timeout=60,
                         check=False)
    assert run.returncode == 0, run.stderr
    calls = Path(env["RAY_LOG"]).read_text().splitlines()
    assert calls == [f"ray start --address={address} --block --disable-usage-stats "
                     f"--object-store-memory={1 << 30}"] * 3
    assert run.stdout.count("waiting for the Ray head") == 2


def test_the_worker_script_fails_when_the_head_never_answers(tmp_path: Path) -> None:
    env = _stand_ins(tmp_path, ray_failures=10_000)
    script = RAY_WORKER_SCRIPT.replace("$(seq 1 180)", "$(seq 1 3)")
    assert script != RAY_WORKER_SCRIPT
    run = subprocess.run(["sh", "-c", script, "ray-worker", "x:6379"], env=env, capture_output=True, text=True,
                         timeout=60, check=False)
    assert run.returncode == 1 and len(Path(env["RAY_LOG"]).read_text().splitlines()) == 3


# --- the operator against the emulator ------------------------------------------------------------------

def ready(cluster: Cluster, name: str = "big") -> dict[str, Any]:
    return condition(cluster.get(DS, name), "Ready")


async def test_without_lws_the_service_says_lws_not_installed_and_retries(cluster: Cluster) -> None:
    async for _ in run_operator(cluster):
        await cluster.create(multinode())
        cond = await cluster.wait_for(lambda: ready(cluster) if ready(cluster).get("reason") else None,
                                      what="Ready condition")
        assert (cond["status"], cond["reason"]) == ("False", "LWSNotInstalled")
        assert "install LeaderWorkerSet" in cond["message"]
        assert condition(cluster.get(DS, "big"), "Degraded")["reason"] == "LWSNotInstalled"
        # Nothing else rolled: no Deployment stands in for the group, the Service is untouched.
        assert cluster.get(DEPLOYMENTS, "big") is None and cluster.get(SERVICES, "big") is None

        # An admin installs LWS: the retry (not a spec change) creates the LeaderWorkerSet.
        serve_leader_worker_sets(cluster.server)
        lws = await cluster.wait_for(lambda: cluster.get(LWS, "big"), what="LeaderWorkerSet after install")
        assert owned_by(lws, cluster.get(DS, "big") or {})
        await cluster.wait_for(lambda: ready(cluster).get("reason") == "ReplicasNotReady", what="LWS status")


async def test_the_lws_is_applied_and_its_status_becomes_the_services(cluster: Cluster) -> None:
    serve_leader_worker_sets(cluster.server)
    async for _ in run_operator(cluster):
        await cluster.create(multinode(replicas=2))
        lws = await cluster.wait_for(lambda: cluster.get(LWS, "big"), what="LeaderWorkerSet")
        assert owned_by(lws, cluster.get(DS, "big") or {}) and cluster.get(DEPLOYMENTS, "big") is None
        assert lws_errors({k: v for k, v in lws.items() if k in ("apiVersion", "kind", "spec")}) == []
        assert lws["spec"]["replicas"] == 2
        service = await cluster.wait_for(lambda: cluster.get(SERVICES, "big"), what="Service")
        assert service["spec"]["selector"][ROLE_LABEL] == LEADER
        ds = await cluster.wait_for(lambda: cluster.get(DS, "big") if ready(cluster) else None, what="status")
        assert ready(cluster)["status"] == "False" and "0/2 replicas (pod groups) ready" in ready(cluster)["message"]
        assert ds["status"]["selector"].endswith(f"{ROLE_LABEL}={LEADER}")  # HPA counts leaders

        # The LWS controller reports one group ready: not Ready yet, and counted from the LWS's status.
        status_path = "/apis/leaderworkerset.x-k8s.io/v1/namespaces/default/leaderworkersets/big/status"
        progressing = {"type": "Progressing", "status": "True", "reason": "GroupsProgressing",
                       "message": "Replicas are progressing", "observedGeneration": 1}
        await cluster.patch(status_path, {"status": {"observedGeneration": 1, "replicas": 2, "readyReplicas": 1,
                                                     "updatedReplicas": 2, "conditions": [progressing]}})
        await cluster.wait_for(lambda: "1/2" in ready(cluster).get("message", ""), what="1/2 groups ready")
        assert (cluster.get(DS, "big") or {})["status"]["readyReplicas"] == 1

        # Both groups ready and Available: Ready, the rollout complete.
        available = {"type": "Available", "status": "True", "reason": "AllGroupsReady",
                     "message": "All replicas are ready", "observedGeneration": 1}
        await cluster.patch(status_path, {"status": {"readyReplicas": 2, "conditions": [
            {**progressing, "status": "False"}, available]}})
        await cluster.wait_for(lambda: ready(cluster).get("status") == "True", what="Ready=True")
        assert condition(cluster.get(DS, "big"), "Progressing")["reason"] == "RolloutComplete"

        # A spec change the LWS controller has not observed yet (generation 2): not Ready until it has.
        await cluster.patch(f"{DS_PATH}/big", {"spec": {"engine": {"maxNumSeqs": 32}}})
        await cluster.wait_for(lambda: (cluster.get(LWS, "big") or {})["metadata"]["generation"] == 2,
                               what="LWS generation 2")
        await cluster.wait_for(lambda: ready(cluster).get("status") == "False", what="Ready=False while stale")


async def test_switching_between_one_node_and_several_swaps_the_workload(cluster: Cluster) -> None:
    serve_leader_worker_sets(cluster.server)
    async for _ in run_operator(cluster):
        await cluster.create(multinode())
        await cluster.wait_for(lambda: cluster.get(LWS, "big"), what="LeaderWorkerSet")

        await cluster.patch(f"{DS_PATH}/big", {"spec": {"resources": {"nodes": 1}}})
        dep = await cluster.wait_for(lambda: cluster.get(DEPLOYMENTS, "big"), what="Deployment")
        await cluster.wait_for(lambda: cluster.get(LWS, "big") is None, what="LeaderWorkerSet deleted")
        assert owned_by(dep, cluster.get(DS, "big") or {})
        await cluster.wait_for(lambda: ROLE_LABEL not in (cluster.get(SERVICES, "big") or {})["spec"]["selector"],
                               what="the Service selects every pod again")

        await cluster.patch(f"{DS_PATH}/big", {"spec": {"resources": {"nodes": 2}}})
        await cluster.wait_for(lambda: cluster.get(LWS, "big"), what="LeaderWorkerSet again")
        await cluster.wait_for(lambda: cluster.get(DEPLOYMENTS, "big") is None, what="Deployment deleted")


async def test_a_foreign_lws_is_left_alone_when_switching_to_one_node(cluster: Cluster) -> None:
    serve_leader_worker_sets(cluster.server)
    foreign = copy.deepcopy(render(multinode()).workload)
    foreign["metadata"]["ownerReferences"] = [{"apiVersion": "v1", "kind": "ConfigMap", "name": "x",
                                               "uid": "someone-else", "controller": True}]
    async with cluster.server.post("/apis/leaderworkerset.x-k8s.io/v1/namespaces/default/leaderworkersets",
                                   json=foreign) as resp:
        assert resp.status < 300, await resp.text()
    async for _ in run_operator(cluster):
        await cluster.create(multinode(resources={"nodes": 1}))
        await cluster.wait_for(lambda: cluster.get(DEPLOYMENTS, "big"), what="Deployment")
        await cluster.wait_for(lambda: ready(cluster), what="status")
    assert cluster.get(LWS, "big") is not None  # not ours: never deleted


async def test_without_rbac_for_lws_the_reason_points_at_the_chart(cluster: Cluster) -> None:
    serve_leader_worker_sets(cluster.server)
    for _ in range(50):  # every apply of the LWS is refused for a while; each rejection answers one request
        cluster.server.reject_next(action.UPDATE, LWS, 403)
    async for _ in run_operator(cluster):
        await cluster.create(multinode())
        cond = await cluster.wait_for(lambda: ready(cluster) if ready(cluster).get("reason") else None,
                                      what="Ready condition")
        assert (cond["status"], cond["reason"]) == ("False", "LWSForbidden")
        assert "upgrade the chart" in cond["message"]
        assert cluster.get(LWS, "big") is None


# --- the builtin autoscaler: leaders scraped, groups scaled ---------------------------------------------

class GroupFleet(Fleet):
    """Fleet's stand-in pods as LWS groups: each leader (scraped) comes with a worker pod, ready and
    reachable, that must never be scraped; the stand-in controller follows the LWS's spec.replicas."""

    def __init__(self, cluster: Cluster, worker_hits: list[str]) -> None:
        super().__init__(cluster)
        self.worker_hits = worker_hits
        self.worker_url = ""

    def replicas(self, service: str) -> int:
        return int(((self.cluster.get(LWS, service) or {}).get("spec") or {}).get("replicas") or 0)

    async def add_pod(self, service: str, mode: str | None = None) -> Pod:
        pod = await super().add_pod(service, mode)
        await self.cluster.patch(f"/api/v1/namespaces/default/pods/{pod.name}",
                                 {"metadata": {"labels": {ROLE_LABEL: LEADER}}})
        worker = f"{pod.name}-1"
        body = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": worker, "namespace": "default", "labels": {
                    **selector_labels(service), ROLE_LABEL: WORKER}},
                "status": {"phase": "Running", "podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}}
        async with self.cluster.server.post("/api/v1/namespaces/default/pods", json=body) as resp:
            assert resp.status < 300, await resp.text()
        self.urls[worker] = self.worker_url
        return pod


async def test_the_autoscaler_scrapes_leaders_and_scales_the_groups(cluster: Cluster) -> None:
    serve_leader_worker_sets(cluster.server)
    hits: list[str] = []

    async def metrics(request: web.Request) -> web.Response:
        hits.append(request.path)
        return web.Response(status=500, text="a worker has no proxy")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    fleet = GroupFleet(cluster, hits)
    fleet.worker_url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    config = AutoscalingConfig(interval_seconds=INTERVAL, scrape=ScrapeSettings(timeout_seconds=2.0),
                               scrape_overrides=fleet.urls)
    body = multinode()
    body["spec"]["policies"]["slo"] = {"ttftMs": 1000, "itlMs": 200}
    body["spec"]["autoscaling"] = {"mode": "builtin", "minReplicas": 1, "maxReplicas": 2, "intervalSeconds": INTERVAL,
                                   "stableWindowSeconds": 1.5, "panicWindowSeconds": 0.6, "scaleDownDelaySeconds": 1}
    try:
        async for _ in run_operator(cluster, resync_seconds=0.5, autoscaling=config):
            follower = asyncio.create_task(fleet.follow("big"))
            try:
                fleet.set_mode("big", "fast")
                await cluster.create(body)
                await cluster.wait_for(lambda: fleet.of("big") and len(fleet.of("big")[0].scrapes) >= 2,
                                       what="two ticks scraping the leader")
                assert fleet.replicas("big") == 1
                fleet.set_mode("big", "slow")
                await cluster.wait_for(lambda: fleet.replicas("big") == 2, timeout=15, what="two groups")
                lws = cluster.get(LWS, "big") or {}
                managers = {(m["manager"], m["operation"]) for m in lws["metadata"].get("managedFields") or []}
                assert ("decodeservice-autoscaler", "Apply") in managers, managers
                await cluster.wait_for(lambda: len(fleet.of("big")) == 2, what="the second group's leader")
            finally:
                follower.cancel()
        assert hits == []  # workers were listed as ready pods of the service, and never scraped
        assert cluster.get(DEPLOYMENTS, "big") is None
    finally:
        await fleet.close()
        await runner.cleanup()
