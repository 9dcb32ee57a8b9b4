"""The fleet router's children (spec.routing.mode: router): pure functions, spec in, dicts out.

With routing on, the Service users call (the DecodeService's own name) selects the router pods, and the
router routes each request to one of the serving pods' proxies, which it finds through the EndpointSlices
of a second, headless Service, `<name>-pods`. The router process is `decodectl router` (router/); what it
is given here is its command-line contract:

    decodectl router --host 0.0.0.0 --port 8000 --service NAME-pods --namespace NS --endpoint-port 8000
                     --policy /etc/decodeservice/policy.yaml --hold-seconds S --max-held N

- the Deployment `<name>-router` (spec.routing.router.replicas, 2 by default), pods labelled
  `app.kubernetes.io/component: router` and `app.kubernetes.io/name: decodeservice-router`: a name label
  of their own, so neither the engine Deployment's selector nor its PDB, its Service or the autoscaler's
  pod census ever counts a router pod;
- its ServiceAccount, and a Role that may only get, list and watch EndpointSlices in the namespace, bound
  to it: the router reads which pods are ready and nothing else (no Secrets, no writes);
- a PDB, so a node drain leaves one router serving;
- the headless Service `<name>-pods` over the serving pods.

The router reads the same policy.yaml as the proxies (the service's ConfigMap): classes, their ttftMs,
tenants and isolatePrefixCache. It holds requests while no pod is ready, and reports them on /metrics
(`decode_router:requests_held`), which the builtin autoscaler reads to scale from zero.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from decodeservice.operator.engines import PROXY_PORT
from decodeservice.operator.routing_spec import RoutingMode
from decodeservice.operator.spec import ValidatedSpec

ROUTER_PORT = 8000
COMPONENT_LABEL = "app.kubernetes.io/component"
ROUTER_COMPONENT = "router"
ROUTER_NAME = "decodeservice-router"
DISCOVERY_GROUP = "discovery.k8s.io"


@dataclass(frozen=True, kw_only=True)
class RouterChildren:
    """What routing mode router adds beside the service's own children."""

    deployment: dict[str, Any]
    service_account: dict[str, Any]
    role: dict[str, Any]
    role_binding: dict[str, Any]
    pdb: dict[str, Any]
    pods_service: dict[str, Any]

    def all(self) -> list[dict[str, Any]]:
        # The ServiceAccount and its Role before the Deployment whose pods use them.
        return [self.service_account, self.role, self.role_binding, self.pods_service, self.deployment, self.pdb]


def routed(v: ValidatedSpec) -> bool:
    return v.routing is RoutingMode.ROUTER


def router_name(name: str) -> str:
    return f"{name}-router"


def pods_service_name(name: str) -> str:
    return f"{name}-pods"


def router_selector(name: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": ROUTER_NAME, "app.kubernetes.io/instance": name}


def router_labels(name: str, managed_by: str) -> dict[str, str]:
    return {**router_selector(name), COMPONENT_LABEL: ROUTER_COMPONENT, "app.kubernetes.io/managed-by": managed_by,
            "decode.dev/service": name}


def router_args(*, name: str, namespace: str, v: ValidatedSpec, policy_path: str) -> list[str]:
    """`decodectl router`'s arguments in a cluster: the pods found through `<name>-pods`' EndpointSlices."""
    router = v.spec.routing.router
    return ["router", "--host", "0.0.0.0", "--port", str(ROUTER_PORT),
            "--service", pods_service_name(name), "--namespace", namespace, "--endpoint-port", str(PROXY_PORT),
            "--policy", policy_path, "--hold-seconds", f"{router.hold_seconds:g}",
            "--max-held", str(router.max_held)]


def _meta(name: str, namespace: str, labels: Mapping[str, str]) -> dict[str, Any]:
    return {"name": name, "namespace": namespace, "labels": dict(labels)}


def _probe(path: str, *, period: int, failures: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period, "timeoutSeconds": 2,
            "failureThreshold": failures}


def build_router(*, name: str, namespace: str, v: ValidatedSpec, serving: Mapping[str, str],
                 image: str, image_pull_policy: str, policy_config_map: str, policy_dir: str,
                 pod_security: Mapping[str, Any], container_security: Mapping[str, Any],
                 drain_seconds: int, managed_by: str, annotations: Mapping[str, str]) -> RouterChildren:
    """The router's children; `serving` selects the pods it routes to (manifests.serving_selector);
    `annotations` go on its pod template (the policy's hash: a changed policy rolls the routers too)."""
    router = v.spec.routing.router
    labels = router_labels(name, managed_by)
    account = router_name(name)
    service_account = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(account, namespace, labels),
                       "automountServiceAccountToken": False}  # only the router pods mount its token
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": _meta(account, namespace, labels),
            "rules": [{"apiGroups": [DISCOVERY_GROUP], "resources": ["endpointslices"],
                       "verbs": ["get", "list", "watch"]}]}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
               "metadata": _meta(account, namespace, labels),
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": account},
               "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": namespace}]}
    # Headless: the router needs the pods' addresses, not a virtual IP; unready pods are left out of
    # the ready endpoints, which is all the router routes to.
    pods_service = {"apiVersion": "v1", "kind": "Service",
                    "metadata": _meta(pods_service_name(name), namespace, labels),
                    "spec": {"clusterIP": "None", "selector": dict(serving),
                             "ports": [{"name": "http", "port": PROXY_PORT, "targetPort": "http", "protocol": "TCP"}]}}
    container = {
        "name": "router", "image": image, "imagePullPolicy": image_pull_policy, "command": ["decodectl"],
        "args": router_args(name=name, namespace=namespace, v=v, policy_path=f"{policy_dir}/policy.yaml"),
        "ports": [{"name": "http", "containerPort": ROUTER_PORT, "protocol": "TCP"}],
        "env": [{"name": "HOME", "value": "/tmp"}],
        "resources": {"requests": {"cpu": router.resources.cpu, "memory": router.resources.memory},
                      "limits": {"memory": router.resources.memory}},
        # /ready answers with no endpoint at all: the router holds requests then, so it must stay in the Service.
        "readinessProbe": _probe("/ready", period=5, failures=3),
        "livenessProbe": _probe("/health", period=10, failures=3),
        "lifecycle": {"preStop": {"sleep": {"seconds": drain_seconds}}},
        "securityContext": dict(container_security),
        "volumeMounts": [{"name": "policy", "mountPath": policy_dir, "readOnly": True},
                         {"name": "tmp", "mountPath": "/tmp"}],
    }
    pod_spec = {
        "serviceAccountName": account, "automountServiceAccountToken": True,  # it watches EndpointSlices
        "securityContext": dict(pod_security), "enableServiceLinks": False,
        # The held requests may wait hold_seconds for a first pod: a stopping router lets them finish.
        "terminationGracePeriodSeconds": int(drain_seconds + router.hold_seconds + 5),
        "containers": [container],
        "volumes": [{"name": "policy", "configMap": {"name": policy_config_map}},
                    {"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}}],
        # Two routers on one node would fall together.
        "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                                       "whenUnsatisfiable": "ScheduleAnyway",
                                       "labelSelector": {"matchLabels": router_selector(name)}}],
    }
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(account, namespace, labels),
        "spec": {"replicas": router.replicas, "revisionHistoryLimit": 3,
                 "selector": {"matchLabels": router_selector(name)},
                 "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
                 "template": {"metadata": {"labels": labels, "annotations": {
                     **annotations, "prometheus.io/scrape": "true", "prometheus.io/port": str(ROUTER_PORT),
                     "prometheus.io/path": "/metrics"}}, "spec": pod_spec}},
    }
    pdb = {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": _meta(account, namespace, labels),
           "spec": {"maxUnavailable": 1, "selector": {"matchLabels": router_selector(name)}}}
    return RouterChildren(deployment=deployment, service_account=service_account, role=role, role_binding=binding,
                          pdb=pdb, pods_service=pods_service)
