"""Typed, self-checking configuration for the model architecture and the engine."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, Literal, get_args, get_origin

from decodeservice.engine.errors import ConfigError

SpeculativeMethod = Literal["ngram", "draft", "self_draft"]

# The KV pool on CPU when `kv_cache_gib` is not given (GiB).
CPU_KV_CACHE_GIB = 1.0


def field_default(cls: type[Any], name: str) -> Any:
    """The default of a config dataclass field: the one source the CLI, the CRD schema and the docs
    read (tests/test_defaults.py checks that they do)."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            if f.default is dataclasses.MISSING:
                raise KeyError(f"{cls.__name__}.{name} has no plain default")
            return f.default
    raise KeyError(f"{cls.__name__} has no field {name!r}")


# The knob table: each user-facing engine field carries its definition once, in its dataclass field's
# metadata (type and default are the field's own). Generated from it: `decodectl engine`'s options
# (cli/engine_cmd.py), the operator's EngineSpec (operator/engine_knobs.py) and the builtin engine's
# args (operator/engines.py), and the CRD's spec.engine schema (both copies): scripts/generate_crd.py,
# whose output tests/test_defaults.py checks is current. The bounds are checked here, in __post_init__.
_KNOB = "decodeservice.knob"


@dataclass(frozen=True, kw_only=True)
class Knob:
    help: str  # one phrase, lower case: the CLI's help and (capitalised) the CRD's description
    flag: str | None = None  # `decodectl engine` option; None: not on the command line
    crd: str | None = None  # property in the CRD's spec.engine (camelCase); None: not in the CRD
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False
    exclusive_maximum: bool = False
    # False: the CRD leaves the field unset when a manifest does, and each engine keeps its own default
    # (vLLM's differ from ours; a CRD default would be passed to both).
    crd_default: bool = True
    off: str | None = None  # a value the CLI and CRD add that means "none of this" (speculative method)
    note: str = ""  # what the CRD's description adds: how the operator uses it


def knob(default: Any, **spec: Any) -> Any:
    """A dataclass field with its default and its Knob."""
    return dataclasses.field(default=default, metadata={_KNOB: Knob(**spec)})


def required_knob(**spec: Any) -> Any:
    return dataclasses.field(metadata={_KNOB: Knob(**spec)})


@dataclass(frozen=True, kw_only=True)
class KnobField:
    """A knob resolved against its field: what each generator needs."""

    name: str
    knob: Knob
    kind: type  # int, float, bool or str
    optional: bool  # `X | None`: None means "the engine decides"
    default: Any  # the field's default; the knob's `off` for a required field that has one
    values: tuple[str, ...]  # the type's Literal values
    choices: tuple[str, ...]  # what the CLI and CRD accept: `off` first, then `values`


def knob_fields(cls: type[Any]) -> tuple[KnobField, ...]:
    hints = typing.get_type_hints(cls)
    out: list[KnobField] = []
    for f in dataclasses.fields(cls):
        spec = f.metadata.get(_KNOB)
        if spec is None:
            continue
        hint, optional = hints[f.name], False
        args = get_args(hint)
        if type(None) in args:
            optional = True
            hint = next(a for a in args if a is not type(None))
        values: tuple[str, ...] = ()
        if get_origin(hint) is Literal:
            values, hint = tuple(get_args(hint)), str
        assert hint in (int, float, bool, str), f"{cls.__name__}.{f.name}: unsupported knob type {hint}"
        default = spec.off if f.default is dataclasses.MISSING else f.default
        choices = ((spec.off,) if spec.off else ()) + values
        out.append(KnobField(name=f.name, knob=spec, kind=hint, optional=optional, default=default,
                             values=values, choices=choices))
    return tuple(out)


def _num(value: float) -> str:
    return f"{value:g}"


def bounds_text(k: Knob) -> str | None:
    """The bounds as the error messages (and docs) say them: '>= 1', 'positive', 'in (0, 1]'."""
    lo, hi = k.minimum, k.maximum
    if lo is not None and hi is not None:
        return f"in {'(' if k.exclusive_minimum else '['}{_num(lo)}, {_num(hi)}{')' if k.exclusive_maximum else ']'}"
    if lo is not None:
        return "positive" if k.exclusive_minimum and lo == 0 else f"{'>' if k.exclusive_minimum else '>='} {_num(lo)}"
    if hi is not None:
        return f"{'<' if k.exclusive_maximum else '<='} {_num(hi)}"
    return None


def _in_bounds(k: Knob, value: float) -> bool:
    if k.minimum is not None and (value <= k.minimum if k.exclusive_minimum else value < k.minimum):
        return False
    return not (k.maximum is not None and (value >= k.maximum if k.exclusive_maximum else value > k.maximum))


def check_knobs(obj: Any, *, prefix: str = "") -> None:
    """Every knob's type, choices and bounds, from the table; cross-field rules stay in __post_init__."""
    for kf in knob_fields(type(obj)):
        value = getattr(obj, kf.name)
        if value is None and kf.optional:
            continue
        name = f"{prefix}{kf.name}"
        if kf.kind is bool and not isinstance(value, bool):
            raise ConfigError(f"{name} must be true or false, not {value!r}")
        if kf.values and value not in kf.values:
            *head, last = kf.values
            raise ConfigError(f"{name} must be {', '.join(head)} or {last}, not {value!r}")
        text = bounds_text(kf.knob)
        if text is not None and not _in_bounds(kf.knob, value):
            raise ConfigError(f"{name} must be {text}")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A Llama-family architecture (Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3), read from GGUF metadata or a
    HF config.json. The families differ only in the fields after eos_token_ids (engine/loader/architectures.py)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Qwen2: the q, k and v projections carry a bias (added after the projection, kept dense).
    qkv_bias: bool = False
    # Qwen3: an RMSNorm over each q and each k head (head_dim wide), before RoPE.
    qk_norm: bool = False
    # Llama 3.x RoPE scaling: rotary frequency i is divided by rope_freq_factors[i] (head_dim // 2 of them:
    # what HF's rope_type llama3 computes, and what llama.cpp stores as rope_freqs.weight). None: plain RoPE.
    rope_freq_factors: tuple[float, ...] | None = dataclasses.field(default=None, repr=False)
    # The window of a model trained with sliding-window attention (Mistral v0.1). Attention here is always
    # full, which is the same while the context fits in the window: max_position_embeddings must.
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "head_dim"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be positive")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even (RoPE rotates pairs)")
        factors = self.rope_freq_factors
        if factors is not None and (len(factors) != self.head_dim // 2 or not all(f > 0 for f in factors)):
            raise ConfigError(f"rope_freq_factors needs head_dim // 2 = {self.head_dim // 2} positive factors")
        if self.sliding_window is not None and self.max_position_embeddings > self.sliding_window:
            raise ConfigError(f"max_position_embeddings={self.max_position_embeddings} exceeds the sliding window "
                              f"{self.sliding_window}; attention is full, exact only within the window")


@dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """Speculative decoding options; see engine/spec_decode."""

    method: SpeculativeMethod = required_knob(
        help="proposal method; none turns speculation off", flag="--speculative-method", crd="method", off="none")
    # The adaptive rule picks fewer where they do not pay.
    num_tokens: int = knob(8, help="the most draft tokens per step, k (the builtin engine adapts k below it; "
                           "vLLM uses it as is)", flag="--num-speculative-tokens", crd="numTokens", minimum=1, maximum=16)
    # n-gram proposer: longest-first match of the last n tokens, n in [min, max].
    ngram_min: int = 1
    ngram_max: int = 4
    # draft proposer: a model sharing the target's vocabulary (name or path).
    draft_model: str | None = knob(None, help="draft model for method draft (a known model name, .gguf file or "
                                   "HF model folder)", flag="--draft-model")
    # self_draft: the target's first L layers plus its final norm and head.
    draft_layers: int | None = knob(None, help="self_draft: how many of the target's layers draft", minimum=1)
    # Hard ceiling: nobody drafts while this many sequences run. Below it, the step's plan decides.
    disable_batch_size: int = knob(32, help="turn speculation off at this many running sequences",
                                   flag="--speculative-disable-batch-size", minimum=1)
    # Per step, the drafts of each request follow its recent acceptance and what the batch's step takes
    # with that many more rows (spec_decode/policy.py): a draft row costs a small fraction of a one-stream
    # step and nearly a full stream's share of a 16-stream one, and by how much depends on the machine,
    # the weights and the thread count. So by default the engine measures the step time by batch size
    # and drafts at start-up, on its own model (spec_decode/cost.py). adaptive=False drafts num_tokens.
    adaptive: bool = True
    # Configured instead: every row, a stream's or a draft's, costs draft_row_cost of a one-row step (a
    # line in place of the measured curve); 0 always drafts num_tokens.
    draft_row_cost: float | None = knob(
        None, help="cost of verifying one more draft, as a fraction of a decode step; sets how fast k shrinks "
        "with low acceptance and large batches (unset: measured at start-up on this machine and model)",
        flag="--speculative-draft-row-cost", minimum=0, maximum=1, exclusive_maximum=True)

    def __post_init__(self) -> None:
        if self.method not in ("ngram", "draft", "self_draft"):
            raise ConfigError(f"unknown speculative method {self.method!r}; use ngram, draft or self_draft")
        check_knobs(self, prefix="speculative ")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ConfigError("need 1 <= ngram_min <= ngram_max")
        if self.method == "draft" and not self.draft_model:
            raise ConfigError("speculative method 'draft' needs draft_model")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | None) -> SpeculativeConfig | None:
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if value.get("method") in (None, "none"):
            return None
        try:
            return cls(**value)
        except TypeError as exc:
            raise ConfigError(f"bad speculative config: {exc}") from exc


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """How the engine runs. Built once; every bad combination is rejected here."""

    block_size: int = knob(16, help="tokens per KV cache block (a power of two)", minimum=1)
    # KV pool size. None: on CPU CPU_KV_CACHE_GIB; on GPU, gpu_memory_fraction of free memory after weights.
    kv_cache_gib: float | None = knob(
        None, help=f"KV cache size in GiB; unset: {CPU_KV_CACHE_GIB:g} GiB on CPU, on a GPU the memory fraction's share "
        "of what the weights leave free", flag="--kv-cache-gib", crd="kvCacheGiB", minimum=0, exclusive_minimum=True,
        note="vLLM on CPU (resources.gpus: 0): unset, half of resources.memory.")
    # The CRD leaves it unset: vLLM and we each keep our own default (both 0.9 today).
    gpu_memory_fraction: float = knob(
        0.9, help="share of the GPU's memory the engine may use", flag="--gpu-memory-fraction",
        crd="gpuMemoryFraction", minimum=0, exclusive_minimum=True, maximum=1, crd_default=False,
        note="Needs resources.gpus > 0; exclusive with kvCacheGiB.")
    # Tests use tiny pools to force preemption.
    num_gpu_blocks_override: int | None = knob(None, help="KV blocks in the pool, whatever its size", minimum=1)
    # The CRD leaves it unset (it said 16 while the engine and the CLI said 64): a builtin pod gets this
    # default, the same as `decodectl engine`, and vLLM gets its own, not ours.
    max_num_seqs: int = knob(64, help="most sequences decoded together in one batch", flag="--max-num-seqs",
                             crd="maxNumSeqs", minimum=1, crd_default=False)
    # Per-step token budget. Small enough that a long prompt, prefilled in chunks of this size, stalls
    # the running decodes for one short step at a time (a chunk's step: benchmarks/served_vs_peers.py's TTFT).
    max_num_batched_tokens: int = knob(512, help="tokens per step, prompt chunks included",
                                       flag="--max-num-batched-tokens", minimum=1)
    max_model_len: int | None = knob(None, help="context length; unset: the model's", flag="--max-model-len",
                                     minimum=2)
    enable_prefix_caching: bool = knob(True, help="reuse the KV cache of prompt prefixes already computed",
                                       flag="--prefix-caching")
    # Activations and KV cache. auto: bfloat16 with quantized weights or on CUDA, else float32.
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = knob(
        "auto", help="activations (auto: bfloat16 with int8/int4 weights or on CUDA, else float32; the KV cache's too "
        "unless kv_cache_dtype says otherwise)",
        flag="--dtype")
    device: str = knob("cpu", help="torch device, e.g. cpu or cuda", flag="--device")
    # Weights: none | int8 (per channel) | int4 (groups of 32) | auto, the source's own precision where
    # the kernels support it (the bundled Q4_1 GGUF: int4, loaded as 4-bit). See engine/quant.
    quantization: Literal["none", "int8", "int4", "auto"] = knob(
        "auto", help="weight format: auto runs the model's own (int4 for a Q4_0/Q4_1 GGUF on CPU); int8 and int4 "
        "run on CPU only", flag="--quantization", crd="quantization")
    # int8/int4 weights (CPU): projection calls of W8A8_ROWS (6) rows or more, i.e. decode batches of 6+
    # streams, prompt chunks and long verifies, run int8 activations x int8 weights (engine/quant/w8a8.py).
    # int8 weights use their own codes: no memory. int4 weights keep an int8 copy of every projection
    # and the head: +1 byte a weight, twice its 4-bit codes. With the int8-dot kernel (int8 activations
    # against the 4-bit codes) it no longer speeds up the bundled int4 model's 32 streams natively
    # (benchmarks/engine_vs_peers.py, variant engine_int4_w8a8).
    # Off by default, for what it costs besides memory: (1) a stream's tokens then depend on its batch
    # (1 row: the weight-only kernel, 6+: int8 activations; tests/engine/quant/test_w8a8.py), so
    # speculative decoding is no longer exact against plain decoding (a verify of 6+ rows rounds as a
    # batch); (2) int8 weights fall under the 0.9 greedy agreement with fp32 that the weight-only path
    # keeps (tests/engine/test_quantized.py);
    # (3) at int4 the copy grows with the model (a byte a weight), which a pod sized for its 4-bit
    # weights would not have. Throughput-bound deployments that accept int8 activations (llama.cpp
    # quantizes its activations to 8 bits on every step) turn it on: `decodectl engine --w8a8`.
    w8a8: bool = knob(
        False, help="int8/int4 weights on CPU: batches and prompt chunks of 6+ rows run int8 activations x int8 "
        "weights (about 1.9x the 32-stream throughput at int4); tokens then depend on the batch, and int4 "
        "weights get an int8 copy (+1 byte a weight)", flag="--w8a8", crd="w8a8", note="Builtin engine only.")
    # The KV pool's rows. int8 (CPU): each (slot, head) row is quantized on write to int8 codes with its own
    # fp32 scale (engine/attention/kv_int8.py): ~half a bf16 pool's bytes, so twice the tokens in the same
    # kv_cache_gib, and the long-context decode step reads half the K/V. auto: the activations' dtype, but
    # int8 where the machine chose fp32 activations for want of native bf16 (engine/plan/planner.py: plan_kv).
    kv_cache_dtype: Literal["auto", "int8"] = knob(
        "auto", help="KV cache rows: auto keeps the activations' dtype (int8 on a CPU without native bf16 "
        "running quantized weights, where they would be fp32); int8 (CPU) stores each row as int8 codes with "
        "its own scale, about half a bf16 row's bytes", flag="--kv-cache-dtype", crd="kvCacheDtype",
        note="Builtin engine on CPU.")
    speculative: SpeculativeConfig | None = None
    num_threads: int | None = knob(None, help="torch CPU threads; unset: torch's choice", flag="--num-threads",
                                   minimum=1)
    # fp32 on CPU: pack the weights once for oneDNN (see engine.model.Linear). False leaves the model as
    # it is given (an engine cannot unpack a model another engine already packed).
    pack_cpu_weights: bool = True
    # CPU: decode steps (up to compiled_step.MAX_ROWS rows: decode batches, verifies) as one torch.compile
    # graph with attention as an opaque op, bit-identical to eager (engine/compiled_step.py); its gain:
    # benchmarks/decode_compile.py (benchmarks/results/decode_compile_int4_w8a8_cpu2.json). Compiled at
    # start-up, before the server is ready: minutes on 2 cores for the one-row graph and each batch graph
    # (two, three with w8a8) the first time; inductor's on-disk cache (TORCHINDUCTOR_CACHE_DIR) brings a
    # restart to seconds.
    # Needs a C++ compiler at run time. Off by default for those minutes and that compiler.
    compile: bool = knob(
        False, help="CPU: decode steps run as one torch.compile graph, bit-identical to eager (one int4 stream "
        "about 1.25x faster), compiled at start-up: minutes the first time, seconds from inductor's cache; "
        "needs a C++ compiler", flag="--compile", crd="compile",
        note="Builtin engine on CPU; needs quantization int4 or int8. The pod's cache volume keeps the graphs "
             "across container restarts.")
    # The same request gets the same tokens whatever it shares its steps with: every projection row takes one
    # kernel whose rows are computed alone (the int8-dot kernel for int4 weights, step_rows.ROW_TILE-padded GEMMs
    # otherwise: quant/linear.py), every attention row the native paged kernel over its own prefix in one
    # order (attention/paged_views.py), and a sampled verify draws as plain decoding would
    # (spec_decode/verify.py). Its cost: benchmarks/deterministic_cost.py.
    deterministic: bool = knob(
        False, help="the same request gets the same tokens whatever its batch, prompt chunking, prefix-cache hits "
        "and speculation: one kernel per row, a fixed reduction order (CPU; costs decode and prompt speed)",
        flag="--deterministic", crd="deterministic",
        note="Builtin engine on CPU. With engine.kind vllm the service is refused: vLLM's batch invariance is an "
             "environment switch for GPUs that the recorded vLLM releases do not show on their command line.")
    # CUDA: replay decode steps (one token per sequence, up to 32 sequences) from CUDA graphs captured at
    # start-up, with flex attention over the paged pool (engine/cuda_graphs.py). Off by default: written
    # for the GPU path but never run on a GPU in this project; only its CPU stand-in is tested.
    cuda_graphs: bool = False

    def __post_init__(self) -> None:
        check_knobs(self)  # each knob's type, choices and bounds, from the table above
        if self.block_size & (self.block_size - 1):
            raise ConfigError("block_size must be a positive power of two")
        if self.max_num_batched_tokens < self.block_size:
            raise ConfigError("max_num_batched_tokens must be at least block_size")
        if self.compile and not self.device.startswith("cpu"):
            raise ConfigError(f"compile runs on CPU only (where it was measured), not on {self.device}")
        if self.cuda_graphs and not self.device.startswith("cuda"):
            raise ConfigError(f"cuda_graphs needs a CUDA device, not {self.device}")
        if self.cuda_graphs and self.block_size < 16:
            # flex attention's Triton kernels tile keys by the page, at least 16 of them (attention/flex.py)
            raise ConfigError(f"cuda_graphs needs block_size >= 16 (flex attention pages), not {self.block_size}")
        if self.deterministic:
            self._check_deterministic()
        if self.kv_cache_dtype == "int8" and not self.device.startswith("cpu"):
            raise ConfigError(f"kv_cache_dtype='int8' runs on CPU only (its attention paths are CPU ones), not on "
                              f"{self.device}; use kv_cache_dtype 'auto'")
        if self.quantization in ("int8", "int4"):
            if not self.device.startswith("cpu"):
                # torch's CUDA int4 kernel wants another packing; on a GPU the engine runs bf16 weights.
                raise ConfigError(f"quantization={self.quantization!r} runs on CPU only; on {self.device} "
                                  "use quantization 'none' or 'auto' (bf16 weights)")
            if self.dtype not in ("auto", "bfloat16", "float32"):
                # bf16 or fp32 activations (the kernels get bf16 rows either way: engine/quant/linear.py)
                raise ConfigError(f"quantization={self.quantization!r} runs bfloat16 or float32 activations, not "
                                  f"{self.dtype}; use dtype auto (this CPU's choice), bfloat16 or float32")

    def _check_deterministic(self) -> None:
        # Each of these switches a row's kernel by what shares its step, which the mode exists to rule out.
        if not self.device.startswith("cpu"):
            raise ConfigError(f"deterministic runs on CPU only (its row-invariant kernels are CPU ones), not on {self.device}")
        if self.w8a8:
            raise ConfigError("deterministic and w8a8 exclude each other: w8a8 gives a row int8 activations only "
                              "in calls of 6+ rows, so its tokens depend on its batch")
        if self.compile:
            raise ConfigError("deterministic and compile exclude each other: the compiled decode step is traced "
                              "with the default row paths; leave compile off")
        if self.dtype == "float16":
            raise ConfigError("deterministic needs float32 or bfloat16 activations (the native attention kernel's)")
