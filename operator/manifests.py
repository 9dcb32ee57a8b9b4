"""Desired child objects of a DecodeService: one pure function, spec in, dicts out.

`build_children` is all the operator (and `decodectl render`) knows about what a DecodeService becomes:
a Deployment (engine + proxy sidecar), or a LeaderWorkerSet when a replica spans several nodes
(operator/leader_worker_set.py), a Service on the proxy port, a ConfigMap with `policy.yaml`, and a
PodDisruptionBudget when more than one replica runs. No API calls happen here; owner references are
added by the handlers with `kopf.adopt` because they need the live object's uid.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from decodeservice.operator.engines import (
    CACHE_DIR,
    ENGINE_PORT,
    MODELS_DIR,
    PROXY_PORT,
    ModelPlan,
    download_commands,
    engine_command,
    plan_models,
)
from decodeservice.operator.errors import InvalidSpecError
from decodeservice.operator.inference_pool import build_inference_pool, pod_labels
from decodeservice.operator.kernel_cache import KERNEL_CACHE_ENV, kernel_cache_dir, kernel_cache_mounts
from decodeservice.operator.leader_worker_set import (
    LEADER,
    ROLE_LABEL,
    build_leader_worker_set,
    multi_node,
    worker_pod_spec,
)
from decodeservice.operator.podspec import dump
from decodeservice.operator.router import RouterChildren, build_router, routed, router_selector
from decodeservice.operator.spec import AutoscalingMode, EngineKind, ValidatedSpec, validate_spec

# Two builds of one Dockerfile (TORCH_VARIANT): CPU torch for the proxy, the init container and CPU
# engines; CUDA torch for builtin engines with resources.gpus > 0 (the CPU wheel cannot see a GPU).
DEFAULT_IMAGE = "ghcr.io/decodeservice/decodeservice:0.1.0"
DEFAULT_CUDA_IMAGE = "ghcr.io/decodeservice/decodeservice:0.1.0-cuda"
DEFAULT_VLLM_IMAGE = "vllm/vllm-openai:v0.32.0"
# vLLM's CPU build, for engine.kind vllm with resources.gpus 0 (the CUDA image cannot run without a GPU).
DEFAULT_VLLM_CPU_IMAGE = "vllm/vllm-openai-cpu:v0.32.0"
POLICY_DIR = "/etc/decodeservice"
MANAGED_BY = "decodeservice-operator"
POLICY_HASH_ANNOTATION = "decode.dev/policy-hash"
RUN_AS = 10001  # the image's non-root user (see Dockerfile)
PROXY_SHUTDOWN_SECONDS = 5  # uvicorn's timeout_graceful_shutdown in proxy/serve.py
ENGINE_DRAIN_SECONDS = 30  # `decodectl engine --drain-timeout-seconds` default (cli/engine_cmd.py)

# The Pod Security Standards "restricted" profile, on every container.
CONTAINER_SECURITY: dict[str, Any] = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "runAsNonRoot": True,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}
POD_SECURITY: dict[str, Any] = {
    "runAsNonRoot": True,
    "runAsUser": RUN_AS,
    "runAsGroup": RUN_AS,
    "fsGroup": RUN_AS,
    "seccompProfile": {"type": "RuntimeDefault"},
}


@dataclass(frozen=True, kw_only=True)
class BuildOptions:
    """Operator-wide settings that are not part of any one DecodeService."""

    image: str = DEFAULT_IMAGE
    cuda_image: str = DEFAULT_CUDA_IMAGE
    vllm_image: str = DEFAULT_VLLM_IMAGE
    router_image: str | None = None  # the fleet routers' (routing mode router); None: `image`
    vllm_cpu_image: str = DEFAULT_VLLM_CPU_IMAGE
    image_pull_policy: str = "IfNotPresent"
    drain_seconds: int = 10  # preStop wait so endpoints drop the pod before the proxy stops accepting
    proxy_drain_timeout_seconds: int = 30  # after SIGTERM, how long the proxy lets in-flight streams finish

    def __post_init__(self) -> None:
        if not self.image or not self.cuda_image or not self.vllm_image:
            raise ValueError("image, cuda_image and vllm_image must be non-empty")
        if self.image_pull_policy not in ("Always", "IfNotPresent", "Never"):
            raise ValueError(f"image_pull_policy must be Always, IfNotPresent or Never, not {self.image_pull_policy!r}")
        if not 0 <= self.drain_seconds <= 300:
            raise ValueError(f"drain_seconds must be within [0, 300], got {self.drain_seconds}")
        if not 1 <= self.proxy_drain_timeout_seconds <= 3600:
            raise ValueError(f"proxy_drain_timeout_seconds must be within [1, 3600], got "
                             f"{self.proxy_drain_timeout_seconds}")

    @property
    def termination_grace_seconds(self) -> int:
        """Long enough for a pod being scaled down to finish its streams before the kubelet kills it.

        The proxy's preStop sleeps drain_seconds + 1, then SIGTERM starts its drain (up to
        proxy_drain_timeout_seconds), then uvicorn closes what is left within PROXY_SHUTDOWN_SECONDS. The
        builtin engine, behind it, drains for ENGINE_DRAIN_SECONDS after its own preStop.
        """
        proxy = self.drain_seconds + 1 + self.proxy_drain_timeout_seconds + PROXY_SHUTDOWN_SECONDS
        engine = self.drain_seconds + ENGINE_DRAIN_SECONDS + PROXY_SHUTDOWN_SECONDS
        return max(proxy, engine) + 2  # a margin for the kubelet's own signalling


@dataclass(frozen=True, kw_only=True)
class Children:
    workload: dict[str, Any]  # the Deployment, or the LeaderWorkerSet of a multi-node service
    service: dict[str, Any]
    config_map: dict[str, Any]
    pdb: dict[str, Any] | None
    inference_pool: dict[str, Any] | None = None
    router: RouterChildren | None = None  # routing mode router: the router in front of the pods

    def all(self) -> list[dict[str, Any]]:
        objs = [self.config_map, self.service, self.workload]
        routing = self.router.all() if self.router is not None else []
        return objs + [o for o in (self.pdb, self.inference_pool) if o is not None] + routing

    @property
    def deployment(self) -> dict[str, Any]:
        """The Deployment of a single-node service; a multi-node one has none (see `workload`)."""
        if self.workload["kind"] != "Deployment":
            raise ValueError(f"a multi-node service has a {self.workload['kind']}, not a Deployment")
        return self.workload


def selector_labels(name: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "decodeservice", "app.kubernetes.io/instance": name}


def serving_selector(name: str, v: ValidatedSpec) -> dict[str, str]:
    """The pods that serve (run the proxy): every pod of a Deployment, the leaders of a LeaderWorkerSet.
    The Service, the InferencePool, status.selector and the autoscaler's scrape select these."""
    return {**selector_labels(name), ROLE_LABEL: LEADER} if multi_node(v) else selector_labels(name)


def _labels(name: str, v: ValidatedSpec) -> dict[str, str]:
    # decode.dev/* labels let a Gateway API InferencePool select the pods of one served model.
    model_label = "".join(c if c.isalnum() or c in "-_." else "-" for c in v.served_name)[:63].strip("-_.")
    return {**selector_labels(name), "app.kubernetes.io/component": "inference",
            "app.kubernetes.io/managed-by": MANAGED_BY, "decode.dev/service": name,
            "decode.dev/model": model_label or "model"}


def _meta(name: str, namespace: str, labels: Mapping[str, str]) -> dict[str, Any]:
    return {"name": name, "namespace": namespace, "labels": dict(labels)}


def desired_replicas(v: ValidatedSpec) -> int:
    scaling = v.spec.autoscaling
    if scaling.mode is AutoscalingMode.OFF:
        return v.spec.replicas
    return max(scaling.min_replicas, min(scaling.max_replicas, v.spec.replicas))


def policy_yaml(v: ValidatedSpec) -> str:
    return v.policy.to_yaml()


def _probe(path: str, port: str, *, period: int, failures: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period, "timeoutSeconds": 2,
            "failureThreshold": failures}


def _engine_container(v: ValidatedSpec, opts: BuildOptions, plan: ModelPlan) -> dict[str, Any]:
    res = v.spec.resources
    command, args = engine_command(v, plan)
    vllm = v.spec.engine.kind is EngineKind.VLLM
    image = v.spec.engine.image or engine_image(v, opts)
    limits: dict[str, str] = {"memory": res.memory}
    if res.gpus > 0:
        limits["nvidia.com/gpu"] = str(res.gpus)
    # vLLM has no /ready; its /health answers once the model is loaded. Ours splits the two.
    ready_path = "/health" if vllm else "/ready"
    mounts = [{"name": "cache", "mountPath": CACHE_DIR}, {"name": "tmp", "mountPath": "/tmp"}, *plan.mounts]
    mounts += kernel_cache_mounts(plan)
    if vllm:
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    requests = {"cpu": res.cpu, "memory": res.memory}
    if plan.ephemeral_request is not None:  # the downloaded model's emptyDir counts against the node's disk
        requests["ephemeral-storage"] = plan.ephemeral_request
    engine = v.spec.engine
    container: dict[str, Any] = {
        "name": "engine", "image": image, "imagePullPolicy": opts.image_pull_policy,
        "command": command, "args": args,
        "ports": [{"name": "engine", "containerPort": ENGINE_PORT, "protocol": "TCP"}],
        "env": _cache_env(plan) + dump(engine.env),
        "resources": {"requests": requests, "limits": limits},
        "startupProbe": _probe("/health", "engine", period=5, failures=360),  # model loads may take 30 min
        "readinessProbe": _probe(ready_path, "engine", period=5, failures=3),
        "livenessProbe": _probe("/health", "engine", period=10, failures=3),
        "lifecycle": {"preStop": {"sleep": {"seconds": opts.drain_seconds}}},
        "securityContext": CONTAINER_SECURITY,
        "volumeMounts": mounts,
    }
    if engine.env_from:
        container["envFrom"] = dump(engine.env_from)
    return container


def engine_image(v: ValidatedSpec, opts: BuildOptions) -> str:
    """The engine's default image for the device: vLLM's (its CPU build when gpus is 0), else ours (CUDA
    torch when gpus > 0)."""
    if v.spec.engine.kind is EngineKind.VLLM:
        return opts.vllm_image if v.spec.resources.gpus > 0 else opts.vllm_cpu_image
    return opts.cuda_image if v.spec.resources.gpus > 0 else opts.image


def _cache_env(plan: ModelPlan) -> list[dict[str, str]]:
    # The root filesystem is read-only: every tool that caches must write under the emptyDirs.
    return [{"name": "HOME", "value": "/tmp"}, {"name": "XDG_CACHE_HOME", "value": CACHE_DIR},
            {"name": KERNEL_CACHE_ENV, "value": kernel_cache_dir(plan)},
            {"name": "HF_HOME", "value": f"{CACHE_DIR}/huggingface"},
            {"name": "TRITON_CACHE_DIR", "value": f"{CACHE_DIR}/triton"},
            # spec.engine.compile: the emptyDir outlives a container restart, so a restarted engine loads
            # its compiled graphs in seconds instead of compiling them again for minutes.
            {"name": "TORCHINDUCTOR_CACHE_DIR", "value": f"{CACHE_DIR}/torchinductor"}]


def _proxy_container(v: ValidatedSpec, opts: BuildOptions) -> dict[str, Any]:
    return {
        "name": "proxy", "image": opts.image, "imagePullPolicy": opts.image_pull_policy,
        "command": ["decodectl"],
        # --engine-kind: the proxy's /ready asks the engine's own readiness route (vLLM has no /ready).
        "args": ["proxy", "--upstream", f"http://127.0.0.1:{ENGINE_PORT}",
                 "--engine-kind", v.spec.engine.kind.value, "--host", "0.0.0.0",
                 "--port", str(PROXY_PORT), "--policy", f"{POLICY_DIR}/policy.yaml",
                 "--drain-timeout-seconds", str(opts.proxy_drain_timeout_seconds)],
        "ports": [{"name": "http", "containerPort": PROXY_PORT, "protocol": "TCP"}],
        "env": [{"name": "HOME", "value": "/tmp"}],
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}},
        "readinessProbe": _probe("/ready", "http", period=5, failures=3),
        "livenessProbe": _probe("/health", "http", period=10, failures=3),
        # The proxy outlives the engine's drain by a second so in-flight streams finish through it.
        "lifecycle": {"preStop": {"sleep": {"seconds": opts.drain_seconds + 1}}},
        "securityContext": CONTAINER_SECURITY,
        "volumeMounts": [{"name": "policy", "mountPath": POLICY_DIR, "readOnly": True},
                         {"name": "tmp", "mountPath": "/tmp"}],
    }


def _init_container(v: ValidatedSpec, plan: ModelPlan, opts: BuildOptions) -> dict[str, Any] | None:
    commands = download_commands(plan)
    if not commands:
        return None
    # One shell-free chain: each download is its own argv, run by Python's subprocess in order.
    runner = "import subprocess, sys, json\nfor cmd in json.loads(sys.argv[1]):\n    subprocess.run(cmd, check=True)\n"
    env: list[dict[str, Any]] = [*_cache_env(plan)]
    token = v.spec.model.token_secret
    if token is not None:  # gated models: the download authenticates; the engine reads local files only
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": token.name, "key": token.key}}})
    return {
        "name": "fetch-model", "image": opts.image, "imagePullPolicy": opts.image_pull_policy,
        "command": ["python", "-c", runner, json.dumps(commands)],
        "env": env,
        "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "2Gi"}},
        "securityContext": CONTAINER_SECURITY,
        "volumeMounts": [{"name": "model-cache", "mountPath": f"{MODELS_DIR}/hf"},
                         {"name": "cache", "mountPath": CACHE_DIR}, {"name": "tmp", "mountPath": "/tmp"}],
    }


def build_children(*, name: str, namespace: str, v: ValidatedSpec,
                   options: BuildOptions | None = None, replicas: int | None = None) -> Children:
    """`replicas` overrides `desired_replicas(v)`: in builtin mode the autoscaler's last decision."""
    opts = options or BuildOptions()
    labels = _labels(name, v)
    policy = policy_yaml(v)
    policy_hash = hashlib.sha256(policy.encode()).hexdigest()[:16]
    plan = plan_models(v)
    replicas = desired_replicas(v) if replicas is None else replicas
    res = v.spec.resources

    config_map = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(f"{name}-policy", namespace, labels),
                  "data": {"policy.yaml": policy}}
    volumes: list[dict[str, Any]] = [
        {"name": "policy", "configMap": {"name": f"{name}-policy"}},
        {"name": "cache", "emptyDir": {"sizeLimit": "20Gi"}},
        {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}},
        *plan.volumes,
    ]
    if v.spec.engine.kind is EngineKind.VLLM:
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}})
    pod_spec: dict[str, Any] = {
        "securityContext": POD_SECURITY,
        "automountServiceAccountToken": False,  # the pods never talk to the API server
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": opts.termination_grace_seconds,
        "containers": [_engine_container(v, opts, plan), _proxy_container(v, opts)],
        "volumes": volumes,
    }
    init = _init_container(v, plan, opts)
    if init is not None:
        pod_spec["initContainers"] = [init]
    if res.node_selector:
        pod_spec["nodeSelector"] = dict(res.node_selector)
    if res.tolerations:
        pod_spec["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True) for t in res.tolerations]
    _pass_through(v, pod_spec, selector=selector_labels(name))
    template: dict[str, Any] = {
        "metadata": {"labels": {**v.spec.pod.labels, **labels, **pod_labels(v)}, "annotations": {
            **v.spec.pod.annotations, POLICY_HASH_ANNOTATION: policy_hash,
            "prometheus.io/scrape": "true", "prometheus.io/port": str(PROXY_PORT),
            "prometheus.io/path": "/metrics"}},
        "spec": pod_spec,
    }
    if multi_node(v):
        # No prometheus.io annotations: a worker has no proxy to scrape (and no empty map, which a server may drop).
        worker_meta: dict[str, Any] = {"labels": {**v.spec.pod.labels, **labels}}
        if v.spec.pod.annotations:
            worker_meta["annotations"] = dict(v.spec.pod.annotations)
        worker = {"metadata": worker_meta, "spec": worker_pod_spec(pod_spec, pod_spec["containers"][0])}
        workload = build_leader_worker_set(name=name, namespace=namespace, v=v, labels=labels, replicas=replicas,
                                           leader=template, worker=worker)
    else:
        workload = _deployment(name, namespace, v, labels=labels, replicas=replicas, template=template)
    serving = serving_selector(name, v)
    router = None
    if routed(v):
        router = build_router(name=name, namespace=namespace, v=v, serving=serving,
                              image=opts.router_image or opts.image,
                              image_pull_policy=opts.image_pull_policy, policy_config_map=f"{name}-policy",
                              policy_dir=POLICY_DIR, pod_security=POD_SECURITY, container_security=CONTAINER_SECURITY,
                              drain_seconds=opts.drain_seconds, managed_by=MANAGED_BY,
                              annotations={POLICY_HASH_ANNOTATION: policy_hash})
    service = {
        "apiVersion": "v1", "kind": "Service", "metadata": _meta(name, namespace, labels),
        # The name users call: the routers when routing is on (they reach the pods through NAME-pods).
        "spec": {"type": "ClusterIP", "selector": router_selector(name) if routed(v) else serving,
                 "ports": [{"name": "http", "port": PROXY_PORT, "targetPort": "http", "protocol": "TCP"}]},
    }
    pdb = None
    # When an autoscaler may run more than one pod, the budget exists from the start: one made only once
    # the count passed 1 would wait for the next reconcile after a scale-up, leaving the new pods
    # unprotected from a node drain in between. maxUnavailable 1 leaves a lone pod evictable as before.
    scaling = v.spec.autoscaling
    may_scale = scaling.mode is not AutoscalingMode.OFF and scaling.max_replicas > 1
    if replicas > 1 or may_scale:
        pdb = {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": _meta(name, namespace, labels),
               "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(name)}}}
    pool = build_inference_pool(name=name, namespace=namespace, v=v, labels=labels, selector=serving)
    return Children(workload=workload, service=service, config_map=config_map, pdb=pdb, inference_pool=pool,
                    router=router)


def _deployment(name: str, namespace: str, v: ValidatedSpec, *, labels: dict[str, str], replicas: int,
                template: dict[str, Any]) -> dict[str, Any]:
    # By default a new pod is Ready before an old one goes (a one-replica service keeps serving);
    # spec.rollout lets a GPU-quota-bound cluster replace in place instead.
    rollout = v.spec.rollout
    rolling = {"maxSurge": rollout.max_surge, "maxUnavailable": rollout.max_unavailable}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(name, namespace, labels),
        "spec": {
            "replicas": replicas,
            "revisionHistoryLimit": 3,
            "selector": {"matchLabels": selector_labels(name)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": rolling},
            "template": template,
        },
    }


def _pass_through(v: ValidatedSpec, pod_spec: dict[str, Any], *, selector: dict[str, str]) -> None:
    """spec.pod's scheduling fields, checked by its models (operator/podspec.py), copied as given."""
    extra = v.spec.pod
    if extra.affinity is not None:
        pod_spec["affinity"] = dump(extra.affinity)
    if extra.topology_spread_constraints:
        # Without a labelSelector a constraint counts no pods at all: spread this service's own.
        pod_spec["topologySpreadConstraints"] = [{"labelSelector": {"matchLabels": dict(selector)}, **dump(c)}
                                                 for c in extra.topology_spread_constraints]
    if extra.runtime_class_name is not None:
        pod_spec["runtimeClassName"] = extra.runtime_class_name
    if extra.priority_class_name is not None:
        pod_spec["priorityClassName"] = extra.priority_class_name
    if extra.image_pull_secrets:
        pod_spec["imagePullSecrets"] = dump(extra.image_pull_secrets)


def render(body: Mapping[str, Any], *, options: BuildOptions | None = None,
           default_namespace: str = "default") -> Children:
    """Children of a whole DecodeService manifest (as `kubectl apply` would get it)."""
    if body.get("apiVersion") != "decode.dev/v1alpha1" or body.get("kind") != "DecodeService":
        raise InvalidSpecError(f"expected apiVersion decode.dev/v1alpha1 and kind DecodeService, got "
                               f"{body.get('apiVersion')!r} {body.get('kind')!r}")
    meta = body.get("metadata") or {}
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidSpecError("metadata.name is required")
    _check_name(name)
    namespace = meta.get("namespace") or default_namespace
    return build_children(name=name, namespace=str(namespace), v=validate_spec(body.get("spec")), options=options)


def _check_name(name: str) -> None:
    # Child names derive from it: the Service needs a DNS-1035 label and `-policy` must still fit 63 chars.
    ok = name[:1].isalpha() and name.islower() and all(c.isalnum() or c == "-" for c in name) and not name.endswith("-")
    if not ok or len(name) > 56:
        raise InvalidSpecError(f"metadata.name: {name!r} must be a DNS-1035 label of at most 56 characters")
