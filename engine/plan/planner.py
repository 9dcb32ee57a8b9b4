"""Builds the ExecutionPlan's parts at start-up: the decisions live here, the measurements in the modules
they time (quant/kernel_plan.py, spec_decode/cost.py), called from here.

CPU and CUDA are planned apart (`_cpu_attention`, `_cuda_attention`): each reads alone.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from decodeservice.engine.attention import native_decode
from decodeservice.engine.attention.backend import AttentionBackend
from decodeservice.engine.config import EngineConfig, ModelConfig
from decodeservice.engine.elementwise import ElementwisePlan
from decodeservice.engine.errors import ConfigError
from decodeservice.engine.kv_cache import cdiv
from decodeservice.engine.plan.attention_tiles import choose_tile_rows
from decodeservice.engine.plan.execution import (
    CONFIGURED,
    AttentionPlan,
    CpuAttentionPlan,
    CudaAttentionPlan,
    ExecutionPlan,
    KvPlan,
    SpeculationPlan,
    StepPlan,
)
from decodeservice.engine.quant.cpu import detect_cpu
from decodeservice.engine.quant.kernel_plan import KernelPlan
from decodeservice.engine.sampling_params import SamplingParams
from decodeservice.engine.scheduler import ScheduledSequence, SchedulerPlan
from decodeservice.engine.sequence import Sequence

if TYPE_CHECKING:
    from decodeservice.engine.runner import ModelRunner

# SpeculativeConfig.draft_row_cost's bound is < 1; a row dearer than a whole step never pays anyway.
ROW_COST_CEILING = 0.99


def plan_kv(config: EngineConfig, *, weight_format: str, activations: torch.dtype, head_dim: int) -> KvPlan:
    """int8 when asked; under auto, int8 where the machine chose fp32 activations for want of native bf16
    (dtype auto, quantized weights, the native kernel built); else the activations' dtype."""
    if config.kv_cache_dtype == "int8":
        return KvPlan(dtype=torch.int8, reason="kv_cache_dtype int8 was asked for", source=CONFIGURED)
    if (torch.device(config.device).type == "cpu" and config.dtype == "auto" and weight_format != "none"
            and activations == torch.float32 and not detect_cpu().native_bf16
            and native_decode.applies(activations, head_dim) and native_decode.decode_extension() is not None):
        # fp32 rows hold 3.8x the bytes of int8 ones, and the long-context decode step pays for every one
        # (benchmarks/kv_cache_dtype.py and long_prompt_quality.py).
        return KvPlan(dtype=torch.int8, reason="auto: fp32 activations for want of native bf16, so int8 rows, not "
                      "fp32 ones", source="capability")
    return KvPlan(dtype=activations, reason="auto: the activations' dtype", source="capability")


def plan_attention(config: EngineConfig, cfg: ModelConfig, *, activations: torch.dtype, kv: KvPlan,
                   num_blocks: int) -> AttentionPlan:
    device = torch.device(config.device)
    if device.type == "cpu":
        return _cpu_attention(config, cfg, activations=activations, kv=kv)
    return _cuda_attention(config, device=device, num_blocks=num_blocks)


def _cpu_attention(config: EngineConfig, cfg: ModelConfig, *, activations: torch.dtype, kv: KvPlan
                   ) -> CpuAttentionPlan:
    """The native paged kernel wherever it is built and takes these shapes, else the plain path alone
    (attention/paged_views.py's docstring says why nothing is raced at start-up)."""
    applies = native_decode.applies(activations, cfg.head_dim)
    native = native_decode.decode_extension() if applies else None
    if config.deterministic and native is None:
        raise ConfigError(
            f"deterministic mode runs every attention row through the native paged-decode kernel, which is "
            f"not available here ({str(activations).removeprefix('torch.')} activations, head_dim "
            f"{cfg.head_dim}: it takes float32 or bfloat16 and head_dim 32, 64 or 128, and needs a C++ "
            "compiler at first start)")
    if config.deterministic:
        why = "deterministic: every row through the native kernel"
    elif native is not None:
        why = "the native kernel is built and takes these shapes"
    elif applies:
        why = "the native kernel did not build here (disabled, no compiler, or it failed its self-check)"
    else:
        why = (f"the native kernel takes float32 or bfloat16 and head_dim 32, 64 or 128, not "
               f"{str(activations).removeprefix('torch.')} and {cfg.head_dim}")
    tiles = None if native is None else choose_tile_rows(
        native, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, activations=activations,
        kv_int8_rows=kv.dtype == torch.int8)
    return CpuAttentionPlan(kernel=native, kv_int8=kv.dtype == torch.int8, deterministic=config.deterministic, why=why,
                            tiles=tiles)


def _cuda_attention(config: EngineConfig, *, device: torch.device, num_blocks: int) -> CudaAttentionPlan:
    if config.deterministic:
        raise ConfigError(f"deterministic attention is the CPU backend's, not {device.type}'s")
    try:
        from decodeservice.engine.attention.flex import MIN_CUDA_BLOCK_SIZE
    except ImportError:  # a torch without torch.nn.attention.flex_attention (before 2.5)
        return CudaAttentionPlan(backend="gather", why=f"torch {torch.__version__} has no flex attention")
    if device.type != "cuda" or num_blocks <= 0:
        return CudaAttentionPlan(backend="gather", why=f"{device.type}: the portable gather backend")
    if config.block_size < MIN_CUDA_BLOCK_SIZE:
        return CudaAttentionPlan(backend="gather", why=f"block_size {config.block_size} is below flex attention's "
                                 f"{MIN_CUDA_BLOCK_SIZE}-key pages")
    return CudaAttentionPlan(backend="flex", why="flex attention over the paged pool")


def build_backend(plan: AttentionPlan, *, num_blocks: int, block_size: int, device: torch.device) -> AttentionBackend:
    """The attention backend `plan` describes, configured once, here."""
    if isinstance(plan, CpuAttentionPlan):
        from decodeservice.engine.attention.paged_views import PagedViewsBackend

        return PagedViewsBackend(kernel=plan.kernel, kv_int8=plan.kv_int8, deterministic=plan.deterministic,
                                 tile_rows=plan.tile_rows)
    if plan.backend == "flex":
        from decodeservice.engine.attention.flex import FlexPagedBackend

        return FlexPagedBackend(num_blocks=num_blocks, block_size=block_size, device=device)
    from decodeservice.engine.attention.gather import GatherBackend

    return GatherBackend()


def plan_step(config: EngineConfig) -> StepPlan:
    if config.compile:
        return StepPlan(executor="compiled", deterministic=False, why="compile was asked for (decode steps of up "
                        "to compiled_step.MAX_ROWS rows as one graph; longer ones eager)")
    if config.cuda_graphs:
        return StepPlan(executor="cuda_graphs", deterministic=False, why="cuda_graphs was asked for")
    return StepPlan(executor="eager", deterministic=config.deterministic,
                    why="deterministic was asked for" if config.deterministic else "the default")


def plan_speculation(config: EngineConfig, runner: ModelRunner, *, num_blocks: int) -> SpeculationPlan | None:
    """Configured, or measured now on `runner` (spec_decode/cost.py): run before any request."""
    spec = config.speculative
    if spec is None:
        return None
    if spec.draft_row_cost is not None:
        return SpeculationPlan(method=spec.method, row_cost=spec.draft_row_cost, curve=None, source=CONFIGURED,
                               seconds=0.0)
    from decodeservice.engine.spec_decode.cost import cached_step_costs

    cost = cached_step_costs(runner, num_tokens=spec.num_tokens, num_blocks=num_blocks,
                             max_batch=min(spec.disable_batch_size - 1, config.max_num_seqs),
                             identity=_step_identity(config, runner))
    return SpeculationPlan(method=spec.method, row_cost=cost.row_cost, curve=cost.curve, source=cost.source,
                           seconds=cost.seconds)


def _step_identity(config: EngineConfig, runner: ModelRunner) -> list[str]:
    """What a step's cost depends on beyond the machine and torch: the speculation curve's cache key."""
    backend = runner.attention_backend
    kernels = runner.model.kernel_plan
    return [f"model {runner.model.config}", f"weights {runner.model.weight_format}", f"kv {runner.kv_dtype}",
            f"attention {backend.name} native {getattr(backend, 'kernel', None) is not None}",
            f"step {plan_step(config).executor} deterministic {config.deterministic}",
            f"kernels {json.dumps(kernels.describe().get('rows'), sort_keys=True) if kernels is not None else None}"]


def execution_plan(config: EngineConfig, *, activations: torch.dtype, activations_reason: str, kv: KvPlan,
                   attention: AttentionPlan, kernels: KernelPlan | None, elementwise: ElementwisePlan,
                   speculation: SpeculationPlan | None) -> ExecutionPlan:
    device = torch.device(config.device)
    machine = (torch.cuda.get_device_name(device) if device.type == "cuda" and torch.cuda.is_available()
               else detect_cpu().model_name)
    return ExecutionPlan(device=str(device), machine=machine, torch_version=torch.__version__, activations=activations,
                         activations_reason=activations_reason, kv=kv, attention=attention, kernels=kernels,
                         elementwise=elementwise, step=plan_step(config), speculation=speculation)


@dataclass(frozen=True, kw_only=True)
class VerifyCost:
    drafts: int
    plain_ms: float  # one sequence's one-row step
    verify_ms: float  # the same with `drafts` draft rows
    row_cost: float  # (verify_ms - plain_ms) / (drafts x plain_ms)


def verify_row_cost(runner: ModelRunner, *, drafts: int, rounds: int = 5) -> VerifyCost:
    """What one more verified draft costs here, as a fraction of a one-row decode step: one sequence's
    step with `drafts` draft rows against its step without, interleaved so that the machine's load hits
    both alike, min over `rounds`. Run before any request: the sequence writes its K/V into the first
    blocks, which are free then (as ModelRunner._warm_up)."""
    blocks = list(range(cdiv(1 + drafts, runner.block_size)))
    seq = Sequence(request_id="verify-cost", prompt_token_ids=[0], params=SamplingParams(max_tokens=drafts + 1),
                   block_ids=blocks)
    seq.spec_token_ids = [0] * drafts  # any tokens: only the time is measured

    def step_ms(k: int) -> float:
        plan = SchedulerPlan(scheduled=[ScheduledSequence(seq=seq, num_new_tokens=1 + k, num_spec_tokens=k)])
        start = time.perf_counter()
        runner.execute(plan)
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
        return (time.perf_counter() - start) * 1000

    step_ms(0), step_ms(drafts)  # first calls pay for kernel selection and allocation
    samples = [(step_ms(0), step_ms(drafts)) for _ in range(rounds)]
    plain, verify = min(a for a, _ in samples), min(b for _, b in samples)
    return VerifyCost(drafts=drafts, plain_ms=plain, verify_ms=verify,
                      row_cost=min(max(verify - plain, 0.0) / (drafts * plain), ROW_COST_CEILING))
