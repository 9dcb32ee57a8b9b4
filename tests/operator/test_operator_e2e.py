"""kopf against kmock's KubernetesEmulator on loopback: the operator as users meet it."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml
from kmock import KubernetesError, action, resource

from decodeservice.operator.manifests import POLICY_HASH_ANNOTATION
from tests.operator.conftest import Cluster, run_operator
from tests.operator.helpers import EXAMPLES
from tests.support.kube_emulator import CONFIGMAPS, DEPLOYMENTS, DS, PDBS, SERVICES

DS_PATH = "/apis/decode.dev/v1alpha1/namespaces/default/decodeservices"


def smoke(name: str = "smoke") -> dict[str, Any]:
    body = copy.deepcopy(yaml.safe_load((EXAMPLES / "cpu-smoke.yaml").read_text()))
    body["metadata"]["name"] = name
    return body


def condition(obj: dict[str, Any] | None, kind: str) -> dict[str, Any]:
    for cond in ((obj or {}).get("status") or {}).get("conditions") or []:
        if cond["type"] == kind:
            return dict(cond)
    return {}


def owned_by(obj: dict[str, Any] | None, owner: dict[str, Any]) -> bool:
    refs = (obj or {}).get("metadata", {}).get("ownerReferences") or []
    return any(r["uid"] == owner["metadata"]["uid"] and r["kind"] == "DecodeService" and r["controller"]
               for r in refs)


async def test_create_makes_owned_children_and_status(operator: Cluster) -> None:
    await operator.create(smoke())
    children = ((DEPLOYMENTS, "smoke"), (SERVICES, "smoke"), (CONFIGMAPS, "smoke-policy"))
    # one reconcile applies them in turn (ConfigMap, Deployment, Service): wait for the last, not the first
    await operator.wait_for(lambda: all(operator.get(res, name) for res, name in children), what="children")
    ds = operator.get(DS, "smoke")
    assert ds is not None
    for res, name in children:
        assert owned_by(operator.get(res, name), ds), f"{res}/{name} lacks the owner reference"
    assert operator.names(PDBS) == []  # one replica: no PDB
    ds = await operator.wait_for(lambda: operator.get(DS, "smoke") if condition(operator.get(DS, "smoke"), "Ready")
                                 else None, what="status")
    assert ds["status"]["observedGeneration"] == 1
    assert condition(ds, "Ready")["status"] == "False"  # no pod is ready yet: nothing runs the Deployment
    assert condition(ds, "Ready")["observedGeneration"] == 1
    assert condition(ds, "Progressing")["status"] == "True"
    assert {c["type"] for c in ds["status"]["conditions"]} == {"Ready", "Progressing", "Degraded", "SLOMet"}
    assert ds["status"]["endpoint"] == "http://smoke.default.svc.cluster.local:8000"

    # The "deployment controller" reports the pod ready: the resync timer turns that into Ready=True.
    await operator.patch("/apis/apps/v1/namespaces/default/deployments/smoke/status", {"status": {
        "observedGeneration": 1, "replicas": 1, "readyReplicas": 1, "updatedReplicas": 1}})
    ds = await operator.wait_for(lambda: operator.get(DS, "smoke")
                                 if condition(operator.get(DS, "smoke"), "Ready").get("status") == "True" else None,
                                 what="Ready=True")
    assert ds["status"]["readyReplicas"] == 1
    assert condition(ds, "Progressing")["reason"] == "RolloutComplete"


async def test_spec_change_updates_children_and_observed_generation(operator: Cluster) -> None:
    await operator.create(smoke())
    first = await operator.wait_for(lambda: operator.get(DEPLOYMENTS, "smoke"), what="Deployment")
    old_hash = first["spec"]["template"]["metadata"]["annotations"][POLICY_HASH_ANNOTATION]

    await operator.patch(f"{DS_PATH}/smoke", {"spec": {"replicas": 3, "engine": {"maxNumSeqs": 32},
                                                       "policies": {"slo": {"ttftMs": 500}}}})
    assert operator.get(DS, "smoke")["metadata"]["generation"] == 2  # type: ignore[index]

    def updated() -> dict[str, Any] | None:
        dep = operator.get(DEPLOYMENTS, "smoke")
        return dep if dep and dep["spec"]["replicas"] == 3 else None

    dep = await operator.wait_for(updated, what="Deployment with 3 replicas")
    assert "32" == dep["spec"]["template"]["spec"]["containers"][0]["args"][
        dep["spec"]["template"]["spec"]["containers"][0]["args"].index("--max-num-seqs") + 1]
    # The policy change rolls the pods: the template's hash annotation changed with the ConfigMap.
    assert dep["spec"]["template"]["metadata"]["annotations"][POLICY_HASH_ANNOTATION] != old_hash
    cm = operator.get(CONFIGMAPS, "smoke-policy")
    assert yaml.safe_load(cm["data"]["policy.yaml"])["slo"]["ttftMs"] == 500  # type: ignore[index]
    await operator.wait_for(lambda: operator.get(PDBS, "smoke"), what="PDB for 3 replicas")
    await operator.wait_for(lambda: (operator.get(DS, "smoke") or {}).get("status", {}).get("observedGeneration") == 2,
                            what="observedGeneration 2")

    # Back to one replica: the PDB goes away again.
    await operator.patch(f"{DS_PATH}/smoke", {"spec": {"replicas": 1}})
    await operator.wait_for(lambda: operator.get(PDBS, "smoke") is None, what="PDB removed")


async def test_invalid_spec_is_ready_false_with_reason(operator: Cluster) -> None:
    body = smoke("bad")
    body["spec"]["model"]["uri"] = "bundled://llama-70b"  # matches the schema pattern; the image lacks it
    await operator.create(body)
    ds = await operator.wait_for(lambda: operator.get(DS, "bad") if condition(operator.get(DS, "bad"), "Ready")
                                 else None, what="Ready condition")
    ready = condition(ds, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec")
    assert "smollm2-135m" in ready["message"]
    assert ds["status"]["observedGeneration"] == 1
    assert operator.get(DEPLOYMENTS, "bad") is None

    # Fixing the spec recovers.
    await operator.patch(f"{DS_PATH}/bad", {"spec": {"model": {"uri": "bundled://smollm2-135m"}}})
    await operator.wait_for(lambda: operator.get(DEPLOYMENTS, "bad"), what="Deployment after the fix")
    await operator.wait_for(lambda: condition(operator.get(DS, "bad"), "Ready").get("reason") != "InvalidSpec",
                            what="InvalidSpec cleared")


async def test_drift_is_repaired_by_the_timer(operator: Cluster) -> None:
    await operator.create(smoke())
    await operator.wait_for(lambda: operator.get(SERVICES, "smoke"), what="Service")
    await operator.wait_for(lambda: operator.get(DEPLOYMENTS, "smoke"), what="Deployment")
    await operator.delete("/api/v1/namespaces/default/services/smoke")
    await operator.patch("/apis/apps/v1/namespaces/default/deployments/smoke", {"spec": {"replicas": 7}})
    await operator.wait_for(lambda: operator.get(SERVICES, "smoke"), what="Service recreated")
    await operator.wait_for(lambda: (operator.get(DEPLOYMENTS, "smoke") or {}).get("spec", {}).get("replicas") == 1,
                            what="replicas repaired")


async def test_orphan_child_is_adopted(cluster: Cluster) -> None:
    # A Service with our name already exists (say, from a previous operator install) and has no owner.
    async with cluster.server.post("/api/v1/namespaces/default/services", json={
            "apiVersion": "v1", "kind": "Service", "metadata": {"name": "smoke", "namespace": "default"},
            "spec": {"ports": [{"port": 9999}]}}) as resp:
        assert resp.status == 200
    async for _ in run_operator(cluster):
        await cluster.create(smoke())
        owner = cluster.get(DS, "smoke") or {}
        svc = await cluster.wait_for(lambda: cluster.get(SERVICES, "smoke")
                                     if owned_by(cluster.get(SERVICES, "smoke"), owner) else None,  # noqa: B023
                                     what="adoption")
        assert svc["spec"]["ports"][0]["port"] == 8000


def applies(cluster: Cluster, res: str) -> list[Any]:
    """Server-side apply requests (PATCH with the apply content type) for one resource."""
    return [r for r in cluster.server[action.UPDATE, resource(res)]
            if r.headers.get("Content-Type", "").startswith("application/apply-patch+yaml")]


@pytest.mark.parametrize("status", [500, 409])
async def test_lost_responses_are_retried_without_duplicates(cluster: Cluster, status: int) -> None:
    # kmock's reactions answer after the emulator stored the write: the apply happened but the client got
    # an error. The retry reads the object back, finds it up to date, and cannot make a twin anyway.
    error = KubernetesError(status=status, reason="Injected", message="injected")
    for res in (DEPLOYMENTS, SERVICES, CONFIGMAPS):
        cluster.server[action.UPDATE, resource(res)][:1] << error
    async for _ in run_operator(cluster):
        await cluster.create(smoke())
        ds = await cluster.wait_for(lambda: cluster.get(DS, "smoke")
                                    if condition(cluster.get(DS, "smoke"), "Progressing") else None, what="status")
        for res, name in ((DEPLOYMENTS, "smoke"), (SERVICES, "smoke"), (CONFIGMAPS, "smoke-policy")):
            assert cluster.names(res) == [name]
            assert owned_by(cluster.get(res, name), ds)
        # No POST at all: every write is an apply to the object's own path, so a retry meets its earlier write.
        assert list(cluster.server[action.CREATE, resource(DEPLOYMENTS)]) == []
        sent = applies(cluster, DEPLOYMENTS)
        assert sent and {r.name for r in sent} == {"smoke"}
        assert {r.params["fieldManager"] for r in sent} == {"decodeservice-operator"}
        assert len(list(cluster.server[action.FETCH, resource(DEPLOYMENTS)])) >= 2  # read back on the retry


@pytest.mark.parametrize("status", [500, 409])
async def test_rejected_writes_are_retried_without_duplicates(cluster: Cluster, status: int) -> None:
    # Rejected before anything is written: the apply must really be sent again.
    cluster.server.reject_next(action.UPDATE, DEPLOYMENTS, status)
    cluster.server.reject_next(action.UPDATE, SERVICES, status)
    async for _ in run_operator(cluster):
        await cluster.create(smoke())
        await cluster.wait_for(lambda: cluster.get(DEPLOYMENTS, "smoke") and cluster.get(SERVICES, "smoke"),
                               what="children after rejected applies")
        assert len(applies(cluster, DEPLOYMENTS)) >= 2  # rejected, then sent again
        cluster.server.reject_next(action.UPDATE, DEPLOYMENTS, status)
        before = len(applies(cluster, DEPLOYMENTS))
        await cluster.patch(f"{DS_PATH}/smoke", {"spec": {"replicas": 2}})
        await cluster.wait_for(lambda: (cluster.get(DEPLOYMENTS, "smoke") or {}).get("spec", {}).get("replicas") == 2,
                               what="replicas 2 after a rejected apply")
        assert len(applies(cluster, DEPLOYMENTS)) >= before + 2
        assert cluster.names(DEPLOYMENTS) == ["smoke"]
        assert cluster.names(SERVICES) == ["smoke"]


@pytest.mark.parametrize("watched", ["team-a", "team-*"])
async def test_a_namespaced_operator_leaves_other_namespaces_alone(cluster: Cluster, watched: str) -> None:
    for namespace in ("team-a", "other"):  # a glob is matched against the namespaces kopf lists
        # Stored directly: kmock fails to parse a POST to the cluster-scoped /api/v1/namespaces.
        cluster.server.objects["v1/namespaces", None, namespace] = {
            "apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": namespace, "uid": namespace, "resourceVersion": "1"}}
    await cluster.create(smoke(), namespace="other")  # first, so an operator watching it would see it first
    await cluster.create(smoke(), namespace="team-a")
    async for _ in run_operator(cluster, namespaces=[watched]):
        await cluster.wait_for(lambda: cluster.get(SERVICES, "smoke", "team-a"), what="team-a Service")
        # One more full cycle in team-a (the resync timer repairs a deleted child): by then an operator
        # that watched `other` would have handled the object created there before.
        await cluster.delete("/api/v1/namespaces/team-a/services/smoke")
        await cluster.wait_for(lambda: cluster.get(SERVICES, "smoke", "team-a"), what="team-a Service recreated")
        assert cluster.get(DEPLOYMENTS, "smoke", "team-a") is not None
        assert cluster.get(DEPLOYMENTS, "smoke", "other") is None
        assert cluster.get(SERVICES, "smoke", "other") is None
        assert "status" not in (cluster.get(DS, "smoke", "other") or {})
