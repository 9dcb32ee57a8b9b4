"""spec.routing: the mode each spec gets, the combinations refused, and the router's children per mode,
rendered by the pure manifest functions (no server) and checked with kubernetes-validate."""

from __future__ import annotations

import copy
from typing import Any

import kubernetes_validate
import pytest
import yaml

from decodeservice.operator.errors import InvalidRoutingError, InvalidSpecError
from decodeservice.operator.kernel_cache import KERNEL_CACHE_ENV, SHARED_KERNEL_CACHE_DIR
from decodeservice.operator.manifests import (
    BuildOptions,
    Children,
    render,
    selector_labels,
    serving_selector,
)
from decodeservice.operator.router import router_selector
from decodeservice.operator.spec import validate_spec
from tests.operator.helpers import CHART, EXAMPLES, load, operator_roles
from tests.operator.schema import validate
from tests.operator.security import rbac_violations, restricted_violations

K8S_VERSION = "1.37"


def manifest(*, autoscaling: dict[str, Any] | None = None, routing: dict[str, Any] | None = None,
             name: str = "svc") -> dict[str, Any]:
    body = copy.deepcopy(load(EXAMPLES / "cpu-smoke.yaml"))
    body["metadata"] = {"name": name, "namespace": "team"}
    if autoscaling is not None:
        body["spec"]["autoscaling"] = autoscaling
    if routing is not None:
        body["spec"]["routing"] = routing
    return body


PICKER = {"name": "epp", "port": {"number": 9002}}
MODES = [
    ("one-replica", None, None, "service"),
    ("static-replicas", None, None, "service"),
    ("autoscaled", {"mode": "builtin", "maxReplicas": 4}, None, "router"),
    ("external-to-zero", {"mode": "external", "minReplicas": 0, "maxReplicas": 4}, None, "router"),
    ("autoscaled-one", {"mode": "builtin", "minReplicas": 1, "maxReplicas": 1}, None, "service"),
    ("explicit-service", {"mode": "builtin", "maxReplicas": 4}, {"mode": "service"}, "service"),
    ("explicit-router", None, {"mode": "router"}, "router"),
    ("pool-old-spelling", {"mode": "builtin", "maxReplicas": 4},
     {"inferencePool": {"enabled": True, "endpointPickerRef": PICKER}}, "inferencePool"),
    ("pool-mode", None, {"mode": "inferencePool", "inferencePool": {"endpointPickerRef": PICKER}}, "inferencePool"),
]


@pytest.mark.parametrize(("case", "autoscaling", "routing", "mode"), MODES, ids=[m[0] for m in MODES])
def test_each_spec_gets_one_routing_mode(case: str, autoscaling: dict[str, Any] | None,
                                         routing: dict[str, Any] | None, mode: str) -> None:
    body = manifest(autoscaling=autoscaling, routing=routing)
    if case == "static-replicas":
        body["spec"]["replicas"] = 3  # autoscaling off: a Service over fixed pods unless asked otherwise
    assert validate_spec(body["spec"]).routing.value == mode
    children = render(body)
    kinds = {(o["kind"], o["metadata"]["name"]) for o in children.all()}
    router_objects = {("Deployment", "svc-router"), ("ServiceAccount", "svc-router"), ("Role", "svc-router"),
                      ("RoleBinding", "svc-router"), ("PodDisruptionBudget", "svc-router"), ("Service", "svc-pods")}
    assert (router_objects <= kinds) is (mode == "router")
    assert not (router_objects & kinds) or mode == "router"
    assert (("InferencePool", "svc") in kinds) is (mode == "inferencePool")
    selector = children.service["spec"]["selector"]
    assert selector == (router_selector("svc") if mode == "router" else selector_labels("svc"))


# Refused by routing_mode (Ready=False InvalidRouting): what the CRD's rules cannot see (an unset mode).
REFUSED = [
    ("zero-without-autoscaler", {"mode": "off", "minReplicas": 0}, None, "needs autoscaling.mode builtin"),
    ("router-zero-without-autoscaler", {"mode": "off", "minReplicas": 0}, {"mode": "router"},
     "needs autoscaling.mode builtin"),
    ("zero-behind-an-old-spelling-pool", {"mode": "builtin", "minReplicas": 0, "maxReplicas": 2},
     {"inferencePool": {"enabled": True, "endpointPickerRef": PICKER}}, "needs routing.mode router, not inferencePool"),
]


@pytest.mark.parametrize(("case", "autoscaling", "routing", "message"), REFUSED, ids=[r[0] for r in REFUSED])
def test_combinations_that_cannot_serve_are_refused(case: str, autoscaling: dict[str, Any] | None,
                                                    routing: dict[str, Any] | None, message: str) -> None:
    with pytest.raises(InvalidRoutingError, match=message) as caught:
        validate_spec(manifest(autoscaling=autoscaling, routing=routing)["spec"])
    assert caught.value.reason == "InvalidRouting"  # the Ready=False reason the handlers report


# Refused at admission by the CRD's CEL rules for the routing fields, and by their Python twins in the
# operator (an API server that does not run CEL, `decodectl render`).
REFUSED_BY_CRD = [
    ("zero-behind-a-service", {"mode": "builtin", "minReplicas": 0, "maxReplicas": 2}, {"mode": "service"},
     "autoscaling.minReplicas: 0 needs routing.mode router"),
    ("zero-behind-a-pool", {"mode": "builtin", "minReplicas": 0, "maxReplicas": 2},
     {"mode": "inferencePool", "inferencePool": {"endpointPickerRef": PICKER}},
     "autoscaling.minReplicas: 0 needs routing.mode router"),
    ("enabled-pool-and-router", None, {"mode": "router", "inferencePool": {"enabled": True, "endpointPickerRef": PICKER}},
     "inferencePool.enabled (the older spelling of mode inferencePool) conflicts with any other mode"),
    ("pool-mode-without-picker", None, {"mode": "inferencePool"}, "mode inferencePool needs inferencePool.endpointPickerRef"),
    ("hold-zero", None, {"router": {"holdSeconds": 0}}, "holdSeconds"),
    ("unknown-mode", None, {"mode": "gateway"}, "is not one of"),
]


@pytest.mark.parametrize(("case", "autoscaling", "routing", "message"), REFUSED_BY_CRD,
                         ids=[r[0] for r in REFUSED_BY_CRD])
def test_the_crd_refuses_routing_that_cannot_serve(case: str, autoscaling: dict[str, Any] | None,
                                                   routing: dict[str, Any] | None, message: str) -> None:
    body = manifest(autoscaling=autoscaling, routing=routing)
    errors = validate(body)
    assert any(message in e or (case == "hold-zero" and "less than or equal to the minimum" in e) for e in errors), errors
    with pytest.raises(InvalidSpecError):
        validate_spec(body["spec"])


@pytest.mark.parametrize(("case", "autoscaling", "routing", "mode"), MODES, ids=[m[0] for m in MODES])
def test_the_crd_admits_every_mode_that_serves(case: str, autoscaling: dict[str, Any] | None,
                                              routing: dict[str, Any] | None, mode: str) -> None:
    assert validate(manifest(autoscaling=autoscaling, routing=routing)) == []


def routed() -> Children:
    return render(manifest(autoscaling={"mode": "builtin", "minReplicas": 0, "maxReplicas": 4},
                           routing={"router": {"replicas": 3, "holdSeconds": 45, "maxHeld": 100,
                                               "resources": {"cpu": "500m", "memory": "300Mi"}}}))


def test_the_router_runs_the_contract_command_line_and_is_valid_and_restricted() -> None:
    children = routed()
    assert children.router is not None
    for obj in children.router.all():
        assert restricted_violations(obj) == [] and rbac_violations(obj) == []
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    deployment = children.router.deployment
    assert deployment["metadata"]["name"] == "svc-router" and deployment["spec"]["replicas"] == 3
    pod = deployment["spec"]["template"]
    assert pod["metadata"]["labels"]["app.kubernetes.io/component"] == "router"
    (container,) = pod["spec"]["containers"]
    assert container["command"] == ["decodectl"]
    assert container["args"] == ["router", "--host", "0.0.0.0", "--port", "8000", "--service", "svc-pods",
                                 "--namespace", "team", "--endpoint-port", "8000",
                                 "--policy", "/etc/decodeservice/policy.yaml", "--hold-seconds", "45",
                                 "--max-held", "100"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["resources"] == {"requests": {"cpu": "500m", "memory": "300Mi"}, "limits": {"memory": "300Mi"}}
    # The proxies' own policy, from the same ConfigMap; a changed policy rolls the routers as it rolls the pods.
    assert pod["spec"]["volumes"][0] == {"name": "policy", "configMap": {"name": "svc-policy"}}
    engine_pod = children.deployment["spec"]["template"]["metadata"]["annotations"]
    assert pod["metadata"]["annotations"]["decode.dev/policy-hash"] == engine_pod["decode.dev/policy-hash"]
    pdb = children.router.pdb
    assert pdb["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": router_selector("svc")}}


def test_router_and_engine_pods_never_select_each_other() -> None:
    children = routed()
    assert children.router is not None
    router_pod = children.router.deployment["spec"]["template"]["metadata"]["labels"]
    engine_pod = children.deployment["spec"]["template"]["metadata"]["labels"]

    def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
        return all(labels.get(k) == v for k, v in selector.items())

    engine_selectors = [children.deployment["spec"]["selector"]["matchLabels"], selector_labels("svc"),
                        serving_selector("svc", validate_spec(manifest(autoscaling={"mode": "builtin",
                                                                                     "maxReplicas": 4})["spec"]))]
    assert children.pdb is not None
    engine_selectors.append(children.pdb["spec"]["selector"]["matchLabels"])
    assert not any(selects(s, router_pod) for s in engine_selectors)  # no Deployment, PDB or census overlap
    assert not selects(router_selector("svc"), engine_pod)
    # Users call the Service with the DecodeService's name: it reaches the routers; they reach the pods
    # through the headless NAME-pods Service's EndpointSlices.
    assert selects(children.service["spec"]["selector"], router_pod)
    pods = children.router.pods_service
    assert pods["spec"]["clusterIP"] == "None" and selects(pods["spec"]["selector"], engine_pod)
    assert pods["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}]


def test_the_router_may_only_read_endpointslices_in_its_namespace() -> None:
    router = routed().router
    assert router is not None
    assert router.role["kind"] == "Role" and router.role["metadata"]["namespace"] == "team"
    assert router.role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                                     "verbs": ["get", "list", "watch"]}]
    assert router.role_binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                              "name": "svc-router"}
    assert router.role_binding["subjects"] == [{"kind": "ServiceAccount", "name": "svc-router", "namespace": "team"}]
    pod = router.deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "svc-router" and pod["automountServiceAccountToken"] is True
    # The account's token is mounted by the router pods alone; the engine pods mount none.
    assert router.service_account["automountServiceAccountToken"] is False
    children = routed()
    assert children.deployment["spec"]["template"]["spec"]["automountServiceAccountToken"] is False


@pytest.mark.parametrize("values", [None, {"watchNamespaces": ["team-a"]}], ids=["cluster", "namespaced"])
def test_the_chart_lets_the_operator_create_the_routers_rbac_and_no_more(values: dict[str, Any] | None) -> None:
    roles = operator_roles(values)
    assert roles
    for role in roles:
        granted = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
                   for v in rule["verbs"]}
        for group, resource in (("", "serviceaccounts"), ("rbac.authorization.k8s.io", "roles"),
                                ("rbac.authorization.k8s.io", "rolebindings")):
            assert {(group, resource, v) for v in ("get", "create", "patch", "delete")} <= granted
        # It can grant only what it holds (no escalate or bind): read-only EndpointSlices, nothing else there.
        assert {v for g, r, v in granted if r == "endpointslices"} == {"get", "list", "watch"}
        assert not {v for _, _, v in granted} & {"escalate", "bind", "impersonate"}
        assert rbac_violations(role) == []


def test_the_kernel_cache_lives_on_the_model_cache_claim_when_there_is_one() -> None:
    def engine(children: Children) -> dict[str, Any]:
        return next(c for c in children.deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "engine")

    def env(container: dict[str, Any]) -> dict[str, str]:
        return {e["name"]: e.get("value", "") for e in container["env"]}

    local = engine(render(manifest()))
    assert env(local)[KERNEL_CACHE_ENV] == "/cache/kernels"  # the cache emptyDir: survives a container restart
    shared_body = manifest()
    shared_body["spec"]["model"] = {"uri": "hf://HuggingFaceTB/SmolLM2-135M-Instruct",
                                    "cache": {"claimName": "models"}}
    children = render(shared_body)
    shared = engine(children)
    assert env(shared)[KERNEL_CACHE_ENV] == SHARED_KERNEL_CACHE_DIR
    mount = next(m for m in shared["volumeMounts"] if m["mountPath"] == SHARED_KERNEL_CACHE_DIR)
    # Writable (the model files beside it are mounted read-only), in a folder of its own on the claim.
    assert mount["name"] == "model-cache" and mount["subPath"] and not mount.get("readOnly")
    volumes = {v["name"]: v for v in children.deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["model-cache"]["persistentVolumeClaim"]["claimName"] == "models"
    kubernetes_validate.validate(children.deployment, K8S_VERSION, strict=True)


def test_the_kernel_cache_variable_is_the_operators_own() -> None:
    body = manifest()
    body["spec"]["engine"]["env"] = [{"name": KERNEL_CACHE_ENV, "value": "/elsewhere"}]
    with pytest.raises(Exception, match="set by the operator"):
        validate_spec(body["spec"])


@pytest.mark.parametrize(("values", "expected"), [
    (None, "ghcr.io/decodeservice/decodeservice:{app}"),
    ({"router": {"image": {"repository": "registry.local/router", "tag": "slim"}}}, "registry.local/router:slim"),
], ids=["operator-image", "override"])
def test_the_chart_hands_the_operator_the_routers_image(values: dict[str, Any] | None, expected: str) -> None:
    import helm_python  # the real Helm SDK, as tests/operator/helpers.py imports it

    with helm_python.Chart.load(CHART) as chart:
        rendered = chart.render(values=values, name="dso", namespace="ops", is_install=True)
    app = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    (deployment,) = [d for path, text in rendered.items() if path.endswith(".yaml") for d in yaml.safe_load_all(text)
                     if d and d["kind"] == "Deployment"]
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--router-image") + 1] == expected.format(app=app)
    routed_children = render(manifest(routing={"mode": "router"}),
                             options=BuildOptions(router_image=expected.format(app=app)))
    assert routed_children.router is not None
    (router,) = routed_children.router.deployment["spec"]["template"]["spec"]["containers"]
    assert router["image"] == expected.format(app=app)
