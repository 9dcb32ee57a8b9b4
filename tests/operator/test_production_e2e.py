"""The production fields through kopf and the API emulator: a bad one is Ready=False, never a pod."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml

from tests.operator.conftest import Cluster
from tests.operator.helpers import EXAMPLES
from tests.support.kube_emulator import DEPLOYMENTS, DS

DS_PATH = "/apis/decode.dev/v1alpha1/namespaces/default/decodeservices"


def smoke(name: str) -> dict[str, Any]:
    body = copy.deepcopy(yaml.safe_load((EXAMPLES / "cpu-smoke.yaml").read_text()))
    body["metadata"]["name"] = name
    return body


def ready(obj: dict[str, Any] | None) -> dict[str, Any]:
    conditions = ((obj or {}).get("status") or {}).get("conditions") or []
    return next((dict(c) for c in conditions if c["type"] == "Ready"), {})


@pytest.mark.parametrize(("change", "message"), [
    (lambda s: s["engine"].update(env=[{"name": "HF_HOME", "value": "/x"}]), "HF_HOME is set by the operator"),
    (lambda s: s.update(pod={"affinity": {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"labelSelector": {}}]}}}), "topologyKey"),
])
async def test_a_bad_production_field_is_ready_false_and_renders_nothing(operator: Cluster, change: Any,
                                                                       message: str) -> None:
    body = smoke("prod")
    change(body["spec"])
    await operator.create(body)
    ds = await operator.wait_for(lambda: operator.get(DS, "prod") if ready(operator.get(DS, "prod")) else None,
                                 what="Ready condition")
    assert (ready(ds)["status"], ready(ds)["reason"]) == ("False", "InvalidSpec")
    assert message in ready(ds)["message"]
    assert operator.get(DEPLOYMENTS, "prod") is None

    # The same service without the bad field: a Deployment whose pods roll without going down.
    await operator.patch(f"{DS_PATH}/prod", {"spec": {"engine": {"env": []}, "pod": {"affinity": None}}})
    deployment = await operator.wait_for(lambda: operator.get(DEPLOYMENTS, "prod"), what="Deployment after the fix")
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
