"""The DecodeService spec, typed and validated in Python.

The CRD's openAPIV3Schema and its `x-kubernetes-validations` are the first line of defence, but the
operator must not trust that the API server enforced them (an older server, a test emulator, `decodectl
render` with no server at all). So every rule is re-checked here, and the rules that need knowledge the
schema lacks (which models the image bundles, which engine supports which feature) live only here.

Each cross-field rule is one entry of `CEL_RULES` (operator/cel_rules.py): its CEL text and its Python
twin side by side. scripts/generate_crd.py copies the spec.engine ones into the CRD; for the rest,
tests/operator/test_crd.py checks that the CRD carries exactly these rule strings, and for every rule that
a CEL evaluator agrees with its twin on the examples and on deliberately invalid manifests.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import Field, ValidationError

from decodeservice.common.camel_model import CamelModel
from decodeservice.engine.loader.architectures import (
    SUPPORTED_GGUF_ARCHITECTURES,
    SUPPORTED_MODEL_TYPES,
    unsupported_model_message,
)
from decodeservice.operator.cel_rules import CEL_RULES as CEL_RULES  # re-exported: tests
from decodeservice.operator.engine_knobs import EngineKnobs, KVCacheDtype, Quantization, SpeculativeKnobs
from decodeservice.operator.engine_knobs import SpecMethod as SpecMethod  # re-exported: engines.py, tests
from decodeservice.operator.errors import DeterministicUnsupportedError, InvalidSpecError
from decodeservice.operator.podspec import (
    DNS_SUBDOMAIN,
    QUANTITY_PATTERN,
    EnvFromSource,
    EnvVar,
    PodSpec,
    TokenSecret,
)
from decodeservice.operator.routing_spec import RoutingMode, RoutingSpec, routing_mode
from decodeservice.proxy.errors import PolicyError
from decodeservice.proxy.policy import Policy

GROUP = "decode.dev"
VERSION = "v1alpha1"
PLURAL = "decodeservices"
KIND = "DecodeService"

# Models the image ships in its cache; `bundled://` anything else cannot start.
BUNDLED_MODELS = ("smollm2-135m",)

MODEL_URI_PATTERN = (
    r"^(bundled://[a-z0-9][a-z0-9.-]*"
    r"|hf://[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+(@[A-Za-z0-9_./-]+)?"
    r"|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?/[^/].*"
    r"|file:///.+)$"
)
_MODEL_URI = re.compile(MODEL_URI_PATTERN)


# The shared camelCase base (decodeservice.common.camel_model); the short local name keeps this file's
# many class lines, and the branches that add to them, unchanged.
_Model = CamelModel


class EngineKind(enum.StrEnum):
    BUILTIN = "builtin"
    VLLM = "vllm"


class AutoscalingMode(enum.StrEnum):
    OFF = "off"
    BUILTIN = "builtin"
    EXTERNAL = "external"


class ModelCacheSpec(_Model):
    """Where hf:// downloads land. claimName: a PVC the service's pods share (the first pod downloads, the
    rest find the files; engines mount it read-only). Unset: an emptyDir per pod, of at most sizeLimit,
    which the engine container requests as ephemeral storage."""

    claim_name: str | None = Field(None, min_length=1, max_length=253, pattern=DNS_SUBDOMAIN)
    size_limit: str = Field("50Gi", pattern=QUANTITY_PATTERN)


# An HF config.json model_type (llama, qwen2, gemma3_text) or a GGUF general.architecture (command-r).
ARCHITECTURE_PATTERN = r"^[a-z0-9][a-z0-9_.-]*$"


class ModelSpec(_Model):
    uri: str = Field(pattern=MODEL_URI_PATTERN)
    served_name: str | None = Field(None, min_length=1, max_length=128)
    architecture: str | None = Field(None, min_length=1, max_length=64, pattern=ARCHITECTURE_PATTERN)
    token_secret: TokenSecret | None = None
    cache: ModelCacheSpec = Field(default_factory=lambda: ModelCacheSpec.model_validate({}))


# The knob fields (max_num_seqs, kv_cache_gib, quantization, w8a8, kv_cache_dtype, compile, deterministic;
# method, num_tokens) come from operator/engine_knobs.py, generated from the engine's knob table
# (engine/config.py) with their defaults and bounds; the fields below are the operator's own.
class SpeculativeSpec(SpeculativeKnobs):
    draft_model: str | None = Field(None, pattern=MODEL_URI_PATTERN)


class EngineSpec(EngineKnobs):
    kind: EngineKind = EngineKind.BUILTIN
    image: str | None = Field(None, min_length=1)
    speculative: SpeculativeSpec = Field(default_factory=lambda: SpeculativeSpec.model_validate({}))
    extra_args: tuple[str, ...] = ()
    env: tuple[EnvVar, ...] = Field((), max_length=128)
    env_from: tuple[EnvFromSource, ...] = Field((), max_length=32)


class Toleration(_Model):
    key: str | None = None
    operator: str | None = Field(None, pattern=r"^(Exists|Equal)$")
    value: str | None = None
    effect: str | None = Field(None, pattern=r"^(NoSchedule|PreferNoSchedule|NoExecute)$")
    toleration_seconds: int | None = None


class ResourcesSpec(_Model):
    gpus: int = Field(0, ge=0, le=16)  # per pod: with nodes > 1, per node of a replica
    # Pods (nodes) per replica. Above 1 a replica is a LeaderWorkerSet group: vLLM shards the model over
    # gpus x nodes GPUs (tensor parallel within a node, pipeline parallel across), Ray joining the pods.
    nodes: int = Field(1, ge=1, le=64)
    cpu: str = Field("2", pattern=QUANTITY_PATTERN)
    memory: str = Field("4Gi", pattern=QUANTITY_PATTERN)
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: tuple[Toleration, ...] = ()


class AutoscalingSpec(_Model):
    mode: AutoscalingMode = AutoscalingMode.OFF
    min_replicas: int = Field(1, ge=0, le=1000)
    max_replicas: int = Field(1, ge=1, le=1000)
    target_inflight_per_replica: int = Field(16, ge=1)
    scale_down_delay_seconds: int = Field(300, ge=0)
    # With minReplicas 0: seconds without a request at the router before the builtin autoscaler scales
    # to zero (the router's decode_router:last_request_timestamp_seconds).
    idle_seconds: int = Field(300, ge=1, le=86400)
    # The builtin autoscaler's knobs. None: the operator's default (intervalSeconds) or the decision
    # side's own default (the rest), so each default has one source: AutoscalerSettings.
    interval_seconds: float | None = Field(None, ge=0.1, le=300)
    stable_window_seconds: float | None = Field(None, gt=0, le=3600)
    panic_window_seconds: float | None = Field(None, gt=0, le=3600)
    scale_up_threshold: float | None = Field(None, gt=0, le=10)
    scale_down_threshold: float | None = Field(None, gt=0, le=10)
    kv_usage_threshold: float | None = Field(None, gt=0, le=1)
    waiting_threshold: float | None = Field(None, gt=0)


class RolloutSpec(_Model):
    """The Deployment's rolling update, in pods. The default surges one new pod and keeps every old one
    serving until it is Ready, so a one-replica service never goes down on a spec change; a cluster whose
    GPU quota has no room for the extra pod sets maxSurge 0, maxUnavailable 1 (down while it rolls)."""

    max_surge: int = Field(1, ge=0, le=100)
    max_unavailable: int = Field(0, ge=0, le=100)


class DecodeServiceSpec(_Model):
    model: ModelSpec
    engine: EngineSpec = Field(default_factory=lambda: EngineSpec.model_validate({}))
    resources: ResourcesSpec = Field(default_factory=lambda: ResourcesSpec.model_validate({}))
    replicas: int = Field(1, ge=0, le=1000)
    autoscaling: AutoscalingSpec = Field(default_factory=lambda: AutoscalingSpec.model_validate({}))
    routing: RoutingSpec = Field(default_factory=lambda: RoutingSpec.model_validate({}))
    rollout: RolloutSpec = Field(default_factory=lambda: RolloutSpec.model_validate({}))
    pod: PodSpec = Field(default_factory=lambda: PodSpec.model_validate({}))
    # Kept as the raw mapping here; `policy` below validates it with the proxy's own model.
    policies: dict[str, Any] = Field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class ModelSource:
    """A parsed model URI. `kind` is bundled, hf, pvc or file."""

    kind: str
    uri: str
    name: str  # bundled name, hf repo id, or path inside the claim / filesystem
    revision: str | None = None  # hf only
    claim: str | None = None  # pvc only


def parse_model_uri(uri: str, *, field: str = "model.uri") -> ModelSource:
    if not _MODEL_URI.match(uri):
        raise InvalidSpecError(f"{field}: {uri!r} is not bundled://NAME, hf://ORG/NAME[@REV], pvc://CLAIM/PATH "
                               "or file:///PATH")
    scheme, rest = uri.split("://", 1)
    if scheme == "bundled":
        if rest not in BUNDLED_MODELS:
            raise InvalidSpecError(f"{field}: the image bundles only {', '.join(BUNDLED_MODELS)}, not {rest!r}")
        return ModelSource(kind="bundled", uri=uri, name=rest)
    if scheme == "hf":
        repo, _, revision = rest.partition("@")
        return ModelSource(kind="hf", uri=uri, name=repo, revision=revision or "main")
    if scheme == "pvc":
        claim, _, path = rest.partition("/")
        return ModelSource(kind="pvc", uri=uri, name=path.rstrip("/"), claim=claim)
    return ModelSource(kind="file", uri=uri, name=rest)


@dataclass(frozen=True, kw_only=True)
class ValidatedSpec:
    """A spec that passed every check, with its parsed parts ready for the manifest builders."""

    spec: DecodeServiceSpec
    model: ModelSource
    draft: ModelSource | None
    policy: Policy
    served_name: str
    routing: RoutingMode


def _format(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors(include_url=False):
        where = ".".join(str(p) for p in err["loc"]) or "spec"
        parts.append(f"spec.{where}: {'unknown field' if err['type'] == 'extra_forbidden' else err['msg']}")
    return "; ".join(parts)


def _at(obj: Mapping[str, Any], path: tuple[str, ...]) -> Mapping[str, Any] | None:
    node: Any = obj
    for key in path:
        if not isinstance(node, Mapping) or key not in node:
            return None
        node = node[key]
    return node if isinstance(node, Mapping) else None


def validate_spec(raw: Mapping[str, Any] | None) -> ValidatedSpec:
    """Parse and check a DecodeService `spec`; raises InvalidSpecError naming every problem it finds."""
    if not isinstance(raw, Mapping):
        raise InvalidSpecError("spec: expected a mapping")
    try:
        spec = DecodeServiceSpec.model_validate(dict(raw))
    except ValidationError as exc:
        raise InvalidSpecError(_format(exc)) from None
    try:
        policy = Policy.from_mapping(spec.policies, source="spec.policies")
    except PolicyError as exc:
        raise InvalidSpecError(str(exc)) from None
    # The CEL twins run on the fully defaulted spec, as the API server would see it after defaulting.
    defaulted = spec.model_dump(mode="json", by_alias=True, exclude_none=True)
    defaulted["policies"] = policy.to_dict()
    for rule in CEL_RULES:
        node = _at(defaulted, rule.path)
        if node is not None and not rule.check(node):
            where = ".".join(("spec", *rule.path))
            raise InvalidSpecError(f"{where}: {rule.message}")
    model = parse_model_uri(spec.model.uri)
    speculative = spec.engine.speculative
    draft = None
    if speculative.draft_model is not None:
        draft = parse_model_uri(speculative.draft_model, field="engine.speculative.draftModel")
    _check_engine(spec, model=model, draft=draft)
    routing = routing_mode(spec.routing, min_replicas=spec.autoscaling.min_replicas,
                           max_replicas=spec.autoscaling.max_replicas,
                           autoscaled=spec.autoscaling.mode is not AutoscalingMode.OFF)
    served = spec.model.served_name or model.name.rstrip("/").rsplit("/", 1)[-1]
    return ValidatedSpec(spec=spec, model=model, draft=draft, policy=policy, served_name=served, routing=routing)


# Set by the operator on the engine container (manifests._cache_env): spec.engine.env may not shadow them.
OPERATOR_ENV = ("HOME", "XDG_CACHE_HOME", "DECODESERVICE_KERNEL_CACHE", "HF_HOME", "TRITON_CACHE_DIR",
                "TORCHINDUCTOR_CACHE_DIR")


def _check_sources(spec: DecodeServiceSpec, *, model: ModelSource, draft: ModelSource | None) -> None:
    downloads = any(s is not None and s.kind == "hf" for s in (model, draft))
    if spec.model.token_secret is not None and not downloads:
        raise InvalidSpecError("spec.model.tokenSecret: only hf:// models are downloaded; this spec has none")
    if spec.model.cache.claim_name is not None and not downloads:
        raise InvalidSpecError("spec.model.cache.claimName: only hf:// downloads use the cache; this spec has none")
    names = [e.name for e in spec.engine.env]
    for i, name in enumerate(names):
        if name in OPERATOR_ENV:
            raise InvalidSpecError(f"spec.engine.env[{i}].name: {name} is set by the operator (the pod's caches "
                                   "live under its volumes)")
        if name in names[:i]:
            raise InvalidSpecError(f"spec.engine.env[{i}].name: {name} is given twice")


def _check_architecture(spec: DecodeServiceSpec) -> None:
    """A model the builtin engine cannot run is refused here, before a pod downloads its weights.

    What the operator can know without a download: a bundled:// model is one of the engine's own registry
    (engine/loader/registry.py), which ships only models the engine runs, so it needs no check. An hf://,
    pvc:// or file:// model is opaque until its config.json is read, so the spec may name its architecture
    (model.architecture) and that hint is checked here; without one, the pod's init container checks an
    hf:// config.json before the weights (engines.HF_CONFIG_CHECK), and the engine checks a pvc:// or
    file:// model at start-up, which downloads nothing. The supported list is the engine's
    (SUPPORTED_MODEL_TYPES), not a CEL enum in the CRD: it belongs to the image, which outlives a CRD
    install. vLLM serves far more architectures, so it is never refused by name."""
    architecture = spec.model.architecture
    if spec.engine.kind is not EngineKind.BUILTIN or architecture is None:
        return
    if architecture not in (*SUPPORTED_MODEL_TYPES, *SUPPORTED_GGUF_ARCHITECTURES):
        raise InvalidSpecError("spec.model.architecture: " + unsupported_model_message(repr(architecture)))


def _check_engine(spec: DecodeServiceSpec, *, model: ModelSource, draft: ModelSource | None) -> None:
    """Rules that need to know what each engine supports; the schema cannot express these."""
    _check_sources(spec, model=model, draft=draft)
    _check_architecture(spec)
    engine = spec.engine
    if draft is not None and draft.kind == "pvc" and model.kind == "pvc" and draft.claim != model.claim:
        raise InvalidSpecError("spec.engine.speculative.draftModel: a pvc:// draft must live on the model's claim "
                               f"{model.claim!r}, not {draft.claim!r}")
    if draft is not None and draft.kind == "pvc" and model.kind != "pvc":
        raise InvalidSpecError("spec.engine.speculative.draftModel: a pvc:// draft needs a pvc:// model on the "
                               "same claim")
    if engine.kind is EngineKind.VLLM:
        if spec.resources.gpus == 0:  # vLLM's CPU build; its KV cache comes from the memory request
            if spec.resources.nodes > 1:
                raise InvalidSpecError("spec.resources.nodes: multi-node vLLM shards a model over GPUs; with "
                                       "resources.gpus 0 run one pod per replica")
            from decodeservice.operator.engines import vllm_cpu_kv_cache_bytes  # engines imports this module

            vllm_cpu_kv_cache_bytes(memory=spec.resources.memory, kv_cache_gib=engine.kv_cache_gib)
        if engine.quantization in (Quantization.INT8, Quantization.INT4):
            raise InvalidSpecError(f"spec.engine.quantization: {engine.quantization.value} is a builtin-engine "
                                   "mode; give vLLM a pre-quantized model instead")
        if engine.kv_cache_gib is not None and spec.resources.gpus > 0:
            raise InvalidSpecError("spec.engine.kvCacheGiB: on GPUs the vllm engine sizes its cache with "
                                   "gpuMemoryFraction")
        if engine.w8a8:
            raise InvalidSpecError("spec.engine.w8a8: a builtin-engine mode; vLLM picks its kernels from the "
                                   "model's quantization")
        if engine.compile:
            raise InvalidSpecError("spec.engine.compile: a builtin-engine mode; vLLM compiles its own graphs")
        if engine.kv_cache_dtype is KVCacheDtype.INT8:
            raise InvalidSpecError("spec.engine.kvCacheDtype: int8 is a builtin-engine mode (CPU); vLLM takes its "
                                   "own --kv-cache-dtype (fp8) through extraArgs")
        if engine.deterministic:
            # vLLM's batch invariance is the VLLM_BATCH_INVARIANT environment variable, on GPUs only; the
            # operator renders only what the recorded releases' command lines show (engines.py).
            raise DeterministicUnsupportedError(
                "spec.engine.deterministic: no vLLM release this operator supports takes a batch-invariance "
                "switch on its command line (vLLM's is the VLLM_BATCH_INVARIANT environment variable, GPUs "
                "only); leave it false and set that variable through engine.env if your vLLM image supports it")
    if engine.kind is EngineKind.BUILTIN and spec.resources.gpus > 1:
        # One process on one device: a second GPU would sit idle while the pod holds it.
        raise InvalidSpecError(f"spec.resources.gpus: the builtin engine runs on one GPU (it has no tensor "
                               f"parallelism), not {spec.resources.gpus}; use engine.kind vllm for a model that "
                               "needs several")
    if (engine.kind is EngineKind.BUILTIN and spec.resources.gpus > 0
            and engine.quantization in (Quantization.INT8, Quantization.INT4)):
        # The engine's int8/int4 kernels are CPU ones: the pod would fail at start-up, every time.
        raise InvalidSpecError(f"spec.engine.quantization: {engine.quantization.value} runs on CPU only; with "
                               "resources.gpus > 0 use auto or none (bf16 weights on the GPU)")
    if engine.kind is EngineKind.BUILTIN and spec.resources.gpus > 0 and engine.w8a8:
        raise InvalidSpecError("spec.engine.w8a8: runs on the CPU's int8 kernels; with resources.gpus > 0 the "
                               "engine runs bf16 weights, so leave it false")
    if engine.kind is EngineKind.BUILTIN and spec.resources.gpus > 0 and engine.kv_cache_dtype is KVCacheDtype.INT8:
        raise InvalidSpecError("spec.engine.kvCacheDtype: int8 KV pools run on the CPU's attention paths; with "
                               "resources.gpus > 0 leave it auto")
    if engine.kind is EngineKind.BUILTIN and engine.deterministic:
        _check_deterministic(spec)
    if engine.kind is EngineKind.BUILTIN and spec.resources.gpus > 0 and engine.compile:
        raise InvalidSpecError("spec.engine.compile: compiles the CPU decode step; with resources.gpus > 0 "
                               "leave it false")
    if engine.kind is EngineKind.BUILTIN and engine.compile and engine.quantization not in (
            Quantization.INT8, Quantization.INT4):
        # The engine refuses compile on dense fp32 weights (oneDNN-packed) at start-up, and `auto` is dense
        # for a dense model: ask for the weight format here rather than let such a pod crash-loop.
        raise InvalidSpecError("spec.engine.compile: needs quantization int4 or int8 (the compiled step runs "
                               f"quantized weights), not {engine.quantization.value}")
    if engine.gpu_memory_fraction is not None and spec.resources.gpus == 0:
        raise InvalidSpecError("spec.engine.gpuMemoryFraction: needs resources.gpus > 0; use kvCacheGiB on CPU")


def _check_deterministic(spec: DecodeServiceSpec) -> None:
    """The builtin engine's deterministic mode, refused here where the engine would refuse it at start-up
    (EngineConfig._check_deterministic), so that no pod crash-loops on it."""
    engine = spec.engine
    if spec.resources.gpus > 0:
        raise DeterministicUnsupportedError("spec.engine.deterministic: the builtin engine's row-invariant kernels "
                                            "are CPU ones; with resources.gpus > 0 leave it false")
    if engine.w8a8:
        raise InvalidSpecError("spec.engine.deterministic: excludes w8a8 (int8 activations from 6 rows a call "
                               "make a stream's tokens depend on its batch)")
    if engine.compile:
        raise InvalidSpecError("spec.engine.deterministic: excludes compile (the compiled decode step keeps "
                               "the default row paths)")
