"""Server-side apply of the children, against the emulator (tests/support/kube_emulator.py + tests/support/server_side_apply.py).

The emulator follows the API server's apply for the fields the operator uses: per-manager field sets in
managedFields, removal of what a manager applied before and no longer applies, other managers' fields
kept, conflicts (409) unless forced, no-op applies that write nothing. What it does NOT model, and only a
real cluster checks: list merge keys other than `name` (real ones: containerPort, mountPath,
port+protocol; tolerations are atomic there and here), `set` lists, defaulting and validation of the
applied result (a real server would default a field we stop applying, e.g. `spec.replicas` back to 1),
status subresource field sets, and admission webhooks.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import kopf
import pytest
from kmock import action, resource

from decodeservice.operator.errors import ApiError
from decodeservice.operator.kube import FIELD_MANAGER, KINDS, KubeClient
from decodeservice.operator.manifests import render
from tests.operator.conftest import Cluster, run_operator
from tests.operator.test_operator_e2e import DS_PATH, applies, condition, smoke
from tests.support.kube_emulator import DEPLOYMENTS, DS

DEPLOY_PATH = "/apis/apps/v1/namespaces/default/deployments/smoke"
T1 = {"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"}
T2 = {"key": "spot", "operator": "Exists", "effect": "NoExecute"}


def pod(cluster: Cluster) -> dict[str, Any]:
    dep = cluster.get(DEPLOYMENTS, "smoke") or {}
    return dict(dep.get("spec", {}).get("template", {}).get("spec", {}))


def names(items: list[dict[str, Any]] | None) -> list[str]:
    return [x["name"] for x in items or []]


@pytest.fixture
async def client(cluster: Cluster) -> AsyncIterator[KubeClient]:
    kube = KubeClient(kopf.ConnectionInfo(server=cluster.url, insecure=True))
    yield kube
    await kube.close()


def config_map(data: dict[str, str], labels: dict[str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "cm", "namespace": "default"}
    if labels is not None:
        meta["labels"] = labels
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data}


async def test_apply_removes_only_what_this_manager_stopped_applying(client: KubeClient) -> None:
    kind = KINDS["ConfigMap"]
    first = await client.apply(kind, "default", "cm", config_map({"a": "1", "b": "2"}, {"x": "1"}))
    assert first["metadata"]["generation"] == 1 and first["data"] == {"a": "1", "b": "2"}
    # A no-op apply writes nothing: same resourceVersion.
    again = await client.apply(kind, "default", "cm", config_map({"a": "1", "b": "2"}, {"x": "1"}))
    assert again["metadata"]["resourceVersion"] == first["metadata"]["resourceVersion"]
    # Another manager adds a key; then we drop `b` and every label.
    await client.apply(kind, "default", "cm", config_map({"c": "3"}), field_manager="someone-else", force=False)
    after = await client.apply(kind, "default", "cm", config_map({"a": "1"}))
    assert after["data"] == {"a": "1", "c": "3"}
    assert "labels" not in after["metadata"]  # the emptied map goes too
    managers = {e["manager"]: e["fieldsV1"] for e in after["metadata"]["managedFields"]}
    assert managers[FIELD_MANAGER] == {"f:data": {"f:a": {}}}
    assert managers["someone-else"] == {"f:data": {"f:c": {}}}


async def test_apply_conflicts_unless_forced(client: KubeClient) -> None:
    kind = KINDS["ConfigMap"]
    await client.apply(kind, "default", "cm", config_map({"a": "1"}), field_manager="kubectl", force=False)
    with pytest.raises(ApiError) as err:
        await client.apply(kind, "default", "cm", config_map({"a": "2"}), force=False)
    assert err.value.status == 409 and 'conflict with "kubectl": .data.a' in err.value.message
    taken = await client.apply(kind, "default", "cm", config_map({"a": "2"}), force=True)
    assert taken["data"] == {"a": "2"}
    assert {e["manager"] for e in taken["metadata"]["managedFields"]} == {FIELD_MANAGER}


async def test_every_kind_of_removal_reaches_the_deployment(cluster: Cluster) -> None:
    body = smoke()
    body["spec"]["model"]["uri"] = "hf://org/tiny-model"
    body["spec"]["resources"]["nodeSelector"] = {"pool": "cpu-a", "zone": "z1"}
    body["spec"]["resources"]["tolerations"] = [T1, T2]
    async for _ in run_operator(cluster):
        await cluster.create(body)
        await cluster.wait_for(lambda: pod(cluster).get("initContainers"), what="Deployment with its init container")
        spec = pod(cluster)
        assert names(spec["initContainers"]) == ["fetch-model"] and "model-cache" in names(spec["volumes"])
        # Someone else's fields: an annotation by a merge patch (an Update) and a nodeSelector key by apply.
        await cluster.patch(DEPLOY_PATH + "?fieldManager=kubectl-annotate", {"spec": {"template": {"metadata": {
            "annotations": {"example.com/owner": "team-a"}}}}})
        async with cluster.server.patch(DEPLOY_PATH, params={"fieldManager": "team-a"}, json={
                "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "smoke", "namespace": "default"},
                "spec": {"template": {"spec": {"nodeSelector": {"team": "a"}}}}},
                headers={"Content-Type": "application/apply-patch+yaml"}) as resp:
            assert resp.status == 200, await resp.text()

        # A map key, a list item, an init container (hf:// -> bundled://) and its volume, in one change.
        await cluster.patch(f"{DS_PATH}/smoke", {"spec": {
            "model": {"uri": "bundled://smollm2-135m"},
            "resources": {"nodeSelector": {"zone": None}, "tolerations": [T1]}}})
        await cluster.wait_for(lambda: "initContainers" not in pod(cluster), what="init container removed")
        spec = pod(cluster)
        assert "model-cache" not in names(spec["volumes"])
        assert all("model-cache" not in names(c["volumeMounts"]) for c in spec["containers"])
        assert spec["nodeSelector"] == {"pool": "cpu-a", "team": "a"}
        assert spec["tolerations"] == [T1]

        # Whole optional sections: tolerations and our nodeSelector keys; team-a's key stays.
        await cluster.patch(f"{DS_PATH}/smoke", {"spec": {"resources": {"nodeSelector": None, "tolerations": None}}})
        await cluster.wait_for(lambda: "tolerations" not in pod(cluster), what="tolerations removed")
        dep = cluster.get(DEPLOYMENTS, "smoke") or {}
        assert pod(cluster)["nodeSelector"] == {"team": "a"}
        assert dep["spec"]["template"]["metadata"]["annotations"]["example.com/owner"] == "team-a"
        assert dep["metadata"]["ownerReferences"][0]["kind"] == "DecodeService"


def fetches(cluster: Cluster) -> int:
    return len(list(cluster.server[action.FETCH, resource(DEPLOYMENTS)]))


async def test_an_unchanged_resync_writes_nothing_and_hand_edits_are_reverted(cluster: Cluster) -> None:
    async for _ in run_operator(cluster):
        await cluster.create(smoke())
        await cluster.wait_for(lambda: cluster.get(DEPLOYMENTS, "smoke"), what="Deployment")
        seen, writes = fetches(cluster), len(applies(cluster, DEPLOYMENTS))
        # Two more resyncs read the Deployment and find it up to date (the applied-hash annotation).
        await cluster.wait_for(lambda: fetches(cluster) >= seen + 2, what="two resyncs")  # noqa: B023
        assert len(applies(cluster, DEPLOYMENTS)) == writes
        # A hand edit of a field we own is applied back (forced: `kubectl edit` owns it for a moment).
        await cluster.patch(DEPLOY_PATH + "?fieldManager=kubectl-edit", {"spec": {"revisionHistoryLimit": 50}})
        await cluster.wait_for(lambda: (cluster.get(DEPLOYMENTS, "smoke") or {})["spec"][
            "revisionHistoryLimit"] == 3, what="hand edit reverted")
        assert len(applies(cluster, DEPLOYMENTS)) == writes + 1


async def test_external_autoscaling_scales_through_the_decodeservice(cluster: Cluster) -> None:
    # An HPA or KEDA targets the DecodeService's scale subresource; the Deployment follows, within bounds.
    body = smoke()
    body["spec"]["autoscaling"] = {"mode": "external", "minReplicas": 1, "maxReplicas": 5}
    async for _ in run_operator(cluster):
        await cluster.create(body)
        await cluster.wait_for(lambda: cluster.get(DEPLOYMENTS, "smoke"), what="Deployment")
        await cluster.patch(f"{DS_PATH}/smoke/scale", {"spec": {"replicas": 4}})
        await cluster.wait_for(lambda: (cluster.get(DEPLOYMENTS, "smoke") or {})["spec"]["replicas"] == 4,
                               what="4 replicas from the scaler")
        await cluster.patch(f"{DS_PATH}/smoke/scale", {"spec": {"replicas": 9}})
        await cluster.wait_for(lambda: (cluster.get(DEPLOYMENTS, "smoke") or {})["spec"]["replicas"] == 5,
                               what="clamped to maxReplicas")
        dep = cluster.get(DEPLOYMENTS, "smoke") or {}
        entry = next(e for e in dep["metadata"]["managedFields"] if e["manager"] == FIELD_MANAGER)
        assert "f:replicas" in entry["fieldsV1"]["f:spec"] and entry["operation"] == "Apply"


async def test_a_child_controlled_by_another_owner_is_refused(cluster: Cluster) -> None:
    foreign = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {
        "name": "smoke-policy", "namespace": "default", "ownerReferences": [{
            "apiVersion": "apps/v1", "kind": "Deployment", "name": "other", "uid": "someone-else",
            "controller": True}]}, "data": {"keep": "me"}}
    async with cluster.server.post("/api/v1/namespaces/default/configmaps", json=foreign) as resp:
        assert resp.status == 200
    async for _ in run_operator(cluster):
        await cluster.create(smoke())
        ds = await cluster.wait_for(lambda: cluster.get(DS, "smoke")
                                    if condition(cluster.get(DS, "smoke"), "Ready") else None, what="Ready")
        assert condition(ds, "Ready")["reason"] == "ChildConflict"
        assert "someone-else" in condition(ds, "Ready")["message"]
        assert cluster.get("v1/configmaps", "smoke-policy")["data"] == {"keep": "me"}  # type: ignore[index]
        assert [r for r in cluster.server[action.UPDATE, resource("v1/configmaps")]] == []


async def test_children_of_the_merge_patch_era_lose_their_leftovers(cluster: Cluster) -> None:
    # What the previous operator left: a Deployment it created (an Update by its user agent) with a
    # nodeSelector key the DecodeService no longer has.
    await cluster.create(smoke())
    ds = cluster.get(DS, "smoke") or {}
    old = render(ds).deployment
    old["spec"]["template"]["spec"]["nodeSelector"] = {"retired": "pool"}
    old["metadata"]["ownerReferences"] = [{"apiVersion": "decode.dev/v1alpha1", "kind": "DecodeService",
                                           "name": "smoke", "uid": ds["metadata"]["uid"], "controller": True,
                                           "blockOwnerDeletion": True}]
    async with cluster.server.post("/apis/apps/v1/namespaces/default/deployments", json=old,
                                   headers={"User-Agent": "decodeservice-operator"}) as resp:
        assert resp.status == 200
    before = cluster.get(DEPLOYMENTS, "smoke") or {}
    assert [(e["manager"], e["operation"]) for e in before["metadata"]["managedFields"]] == [
        (FIELD_MANAGER, "Update")]
    async for _ in run_operator(cluster):
        await cluster.wait_for(lambda: "nodeSelector" not in pod(cluster), what="leftover nodeSelector removed")
        dep = cluster.get(DEPLOYMENTS, "smoke") or {}
        assert [(e["manager"], e["operation"]) for e in dep["metadata"]["managedFields"]] == [(FIELD_MANAGER, "Apply")]
