"""Typed, self-checking configuration for the model architecture and the engine."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

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


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A Llama-family architecture, read from GGUF metadata or a HF config.json."""

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

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "head_dim"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be positive")


@dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """Speculative decoding options; see engine/spec_decode."""

    method: SpeculativeMethod
    num_tokens: int = 8  # the most drafts per step; the adaptive rule picks fewer where they do not pay
    # n-gram proposer: longest-first match of the last n tokens, n in [min, max].
    ngram_min: int = 1
    ngram_max: int = 4
    # draft proposer: a model sharing the target's vocabulary (name or path).
    draft_model: str | None = None
    # self_draft: the target's first L layers plus its final norm and head.
    draft_layers: int | None = None
    # Hard ceiling: nobody drafts while this many sequences run. Below it, `draft_row_cost` decides.
    disable_batch_size: int = 32
    # Per request, k follows the request's recent acceptance and the batch size (see decoder.py):
    # position j is drafted only while its expected acceptance beats its cost.
    adaptive: bool = True
    # What verifying one more position costs, as a fraction of a batch-1 decode step. Measured with
    # benchmarks/decode_step.py (verify_row_cost: 1 row vs 1 + k rows of one sequence, interleaved, min of
    # 12, 1 thread): 0.26 at k = 8 and 0.27-0.30 at k = 4 for the default int4 weights of the bundled model
    # (1-row step 15-16.5 ms, +8 rows 47-50 ms: the int4 kernel's cost grows with rows), at 36- and
    # 203-token contexts; about 0.04 for oneDNN-packed fp32 weights on 2 cores. On a GPU
    # at small batch it is far lower. A draft at position j pays when P(accepted) > draft_row_cost x
    # batch size, so the same rule turns speculation down as the batch grows and turns it off for
    # requests whose drafts keep failing. 0 always drafts num_tokens.
    draft_row_cost: float = 0.25

    def __post_init__(self) -> None:
        if self.method not in ("ngram", "draft", "self_draft"):
            raise ConfigError(f"unknown speculative method {self.method!r}; use ngram, draft or self_draft")
        if not 1 <= self.num_tokens <= 16:
            raise ConfigError("speculative num_tokens must be in [1, 16]")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ConfigError("need 1 <= ngram_min <= ngram_max")
        if self.method == "draft" and not self.draft_model:
            raise ConfigError("speculative method 'draft' needs draft_model")
        if self.draft_layers is not None and self.draft_layers < 1:
            raise ConfigError("draft_layers must be >= 1")
        if self.disable_batch_size < 1:
            raise ConfigError("disable_batch_size must be >= 1")
        if not 0.0 <= self.draft_row_cost < 1.0:
            raise ConfigError("draft_row_cost must be in [0, 1)")

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

    block_size: int = 16
    # KV pool size. None: on CPU CPU_KV_CACHE_GIB; on GPU, gpu_memory_fraction of free memory after weights.
    kv_cache_gib: float | None = None
    gpu_memory_fraction: float = 0.9
    num_gpu_blocks_override: int | None = None  # tests use tiny pools to force preemption
    max_num_seqs: int = 64
    # Per-step token budget. Small enough that a long prompt, prefilled in chunks of this size, stalls
    # the running decodes for one short step at a time (about 0.5 s on 2 CPU cores).
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    # Activations and KV cache. auto: bfloat16 with quantized weights or on CUDA, else float32.
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    device: str = "cpu"
    # Weights: none | int8 (per channel) | int4 (groups of 32) | auto, the source's own precision where
    # the kernels support it (the bundled Q4_1 GGUF: int4, loaded as 4-bit). See engine/quant.
    quantization: Literal["none", "int8", "int4", "auto"] = "auto"
    # int8/int4 weights (CPU): projection calls of W8A8_ROWS (6) rows or more, i.e. decode batches of 6+
    # streams, prompt chunks and long verifies, run int8 activations x int8 weights (engine/quant/w8a8.py).
    # int8 weights use their own codes: no memory. int4 weights keep an int8 copy of every projection
    # and the head: +1 byte a weight, +129 MiB for SmolLM2-135M (its 4-bit projections and head: 80 MiB).
    # Measured on the bundled int4 model with benchmarks/engine_vs_peers.py, on vs off in one run
    # (benchmarks/results/engine_vs_peers_w8a8_cpu{1,2}.json, 1 / 2 threads): 32-stream aggregate
    # 334 vs 193 / 474 vs 355 tokens/s, i.e. 6.2x / 6.3x its own single stream (which W8A8 does not
    # touch); TTFT on ~550 tokens 0.84 vs 1.34 / 0.48 vs 0.75 s; peak RSS 964 vs 816 / 1084 vs 814 MiB,
    # i.e. 0.57x / 0.64x fp32's against 0.48x.
    # Off by default, for what it costs besides memory: (1) a stream's tokens then depend on its batch
    # (1 row: the weight-only kernel, 6+: int8 activations; 8 int4 streams together vs alone agreed on
    # 42% of 32 greedy tokens), so speculative decoding is no longer exact against plain decoding (a
    # verify of 6+ rows rounds as a batch); (2) int8 weights fall under the 0.9 greedy agreement with
    # fp32 that the weight-only path keeps (0.90 vs 0.95; int4 0.85 vs 0.87, tests/engine/test_quantized.py);
    # (3) at int4 the copy grows with the model (+8 GiB for an 8B model), which a pod sized for its 4-bit
    # weights would not have. Throughput-bound deployments that accept int8 activations (llama.cpp
    # quantizes its activations to 8 bits on every step) turn it on: `decodectl engine --w8a8`.
    w8a8: bool = False
    speculative: SpeculativeConfig | None = None
    num_threads: int | None = None
    # fp32 on CPU: pack the weights once for oneDNN (see engine.model.Linear). False leaves the model as
    # it is given (an engine cannot unpack a model another engine already packed).
    pack_cpu_weights: bool = True
    # CPU: decode steps (up to compiled_step.MAX_ROWS rows: decode batches, verifies) as one torch.compile
    # graph with attention as an opaque op, bit-identical to eager (engine/compiled_step.py). Measured on
    # the bundled int4 model, 1 thread, interleaved A/B in one process: one stream 12.9 vs 16.3 ms a step;
    # int8 22.2 vs 25.5 ms; 32 streams with w8a8 69 vs 75 ms. Compiled at start-up, before the server is
    # ready: on 2 cores about 1 min for the one-row graph and 1.5 min for each batch graph (two, three with
    # w8a8) the first time; inductor's on-disk cache (TORCHINDUCTOR_CACHE_DIR) brings a restart to ~6 s.
    # Needs a C++ compiler at run time. Off by default for those minutes and that compiler.
    compile: bool = False
    # CUDA: replay decode steps (one token per sequence, up to 32 sequences) from CUDA graphs captured at
    # start-up, with flex attention over the paged pool (engine/cuda_graphs.py). Off by default: written
    # for the GPU path but never run on a GPU in this project; only its CPU stand-in is tested.
    cuda_graphs: bool = False

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError("block_size must be a positive power of two")
        if self.kv_cache_gib is not None and self.kv_cache_gib <= 0:
            raise ConfigError("kv_cache_gib must be positive")
        if not 0.0 < self.gpu_memory_fraction <= 1.0:
            raise ConfigError("gpu_memory_fraction must be in (0, 1]")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ConfigError("num_gpu_blocks_override must be >= 1")
        if self.max_num_seqs < 1:
            raise ConfigError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < self.block_size:
            raise ConfigError("max_num_batched_tokens must be at least block_size")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError("max_model_len must be >= 2")
        if self.quantization not in ("none", "int8", "int4", "auto"):
            raise ConfigError(f"quantization must be none, int8, int4 or auto, not {self.quantization!r}")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ConfigError("dtype must be auto, float32, float16 or bfloat16")
        if not isinstance(self.w8a8, bool):
            raise ConfigError(f"w8a8 must be true or false, not {self.w8a8!r}")
        if self.compile and not self.device.startswith("cpu"):
            raise ConfigError(f"compile runs on CPU only (where it was measured), not on {self.device}")
        if self.cuda_graphs and not self.device.startswith("cuda"):
            raise ConfigError(f"cuda_graphs needs a CUDA device, not {self.device}")
        if self.cuda_graphs and self.block_size < 16:
            # flex attention's Triton kernels tile keys by the page, at least 16 of them (attention/flex.py)
            raise ConfigError(f"cuda_graphs needs block_size >= 16 (flex attention pages), not {self.block_size}")
        if self.quantization in ("int8", "int4"):
            if not self.device.startswith("cpu"):
                # torch's CUDA int4 kernel wants another packing; on a GPU the engine runs bf16 weights.
                raise ConfigError(f"quantization={self.quantization!r} runs on CPU only; on {self.device} "
                                  "use quantization 'none' or 'auto' (bf16 weights)")
            if self.dtype not in ("auto", "bfloat16"):
                raise ConfigError(f"quantization={self.quantization!r} needs bfloat16 activations (its kernels "
                                  f"are slower than fp32 weights with {self.dtype}); use dtype auto or bfloat16")
