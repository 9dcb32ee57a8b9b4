"""The engine's execution plan: every choice that depends on the machine, made once at start-up.

    plan = ExecutionPlan(...)          # engine/plan/planner.py builds it; Engine holds it
    print("\n".join(plan.explain()))   # `decodectl engine --explain-plan`; /v1/models serves plan.describe()

Each part is handed to the component it configures when that component is built: the KV pool's dtype
and the attention plan to the runner (which builds its backend from it), the kernel plan to the
projections (quant/kernel_plan.py), the elementwise passes to the layers (elementwise.py), the
speculation costs to the speculative decoder. Nothing is changed on a component afterwards. Each choice
carries where it came from: `configured` (a setting asked for it), `measured now` (timed at this
start-up), or the disk cache file it was read from.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal

import torch

from decodeservice.engine.attention import native_decode
from decodeservice.engine.elementwise import ElementwisePlan
from decodeservice.engine.quant.kernel_plan import KernelPlan
from decodeservice.engine.spec_decode.policy import StepCostCurve

if TYPE_CHECKING:  # plan/attention_tiles.py imports MEASURED_NOW from here
    from decodeservice.engine.plan.attention_tiles import TileChoice

CONFIGURED, MEASURED_NOW = "configured", "measured now"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True, kw_only=True)
class KvPlan:
    """The KV pool's rows: the activations' dtype, or int8 rows with their scale (attention/kv_int8.py)."""

    dtype: torch.dtype
    reason: str
    source: str  # CONFIGURED, or "capability" (read from the CPU's flags and the built kernels)


@dataclass(frozen=True, kw_only=True)
class CpuAttentionPlan:
    """How the CPU backend (attention/paged_views.py) reads the pool: the native kernel, else the plain path."""

    # The native paged kernel (attention/native_decode.py) for every decode, verify and prompt span, or None:
    # every span on the plain path (attention/gather.py).
    kernel: ModuleType | None
    kv_int8: bool  # the pools hold int8 rows
    deterministic: bool  # every span through the kernel, a row per token
    why: str
    # The kernel's tile height for a span's rows, timed on this CPU (plan/attention_tiles.py); None: no kernel.
    tiles: TileChoice | None = None

    @property
    def tile_rows(self) -> int:
        return self.tiles.rows if self.tiles is not None else native_decode.TILE_ROWS

    @property
    def backend(self) -> str:
        return "paged_views"

    def describe(self) -> dict[str, Any]:
        return {"backend": self.backend, "native_decode": self.kernel is not None,
                "native_prompt": self.kernel is not None, "kv_int8": self.kv_int8,
                "deterministic": self.deterministic, "why": self.why, "source": "capability",
                "tiles": self.tiles.describe() if self.tiles is not None else None}


@dataclass(frozen=True, kw_only=True)
class CudaAttentionPlan:
    """CUDA: flex attention over the pool (attention/flex.py) where torch has it, else the gather backend."""

    backend: Literal["flex", "gather"]
    why: str

    def describe(self) -> dict[str, Any]:
        return {"backend": self.backend, "why": self.why, "source": "capability"}


AttentionPlan = CpuAttentionPlan | CudaAttentionPlan


@dataclass(frozen=True, kw_only=True)
class StepPlan:
    """How a step's forward runs: eager, one compiled graph (compiled_step.py) or CUDA graphs."""

    executor: Literal["eager", "compiled", "cuda_graphs"]
    deterministic: bool  # every row on its row-invariant path (quant/step_rows.py)
    why: str


@dataclass(frozen=True, kw_only=True)
class SpeculationPlan:
    """What a draft row costs here, the speculative decoder's budget (spec_decode/policy.py)."""

    method: str
    row_cost: float  # one more draft row, as a fraction of a one-row step
    curve: StepCostCurve | None  # step times by batch and draft rows (None: the configured line)
    source: str  # CONFIGURED, MEASURED_NOW or the cache file it was read from (spec_decode/cost.py)
    seconds: float  # what measuring took, at this start or when the cached curve was measured (0 where configured)


@dataclass(frozen=True, kw_only=True)
class ExecutionPlan:
    device: str
    machine: str  # the CPU's or GPU's model name
    torch_version: str
    activations: torch.dtype
    activations_reason: str
    kv: KvPlan
    attention: AttentionPlan
    kernels: KernelPlan | None  # quantized projections on CPU; None: dense weights
    elementwise: ElementwisePlan  # the layers' norms, activation and RoPE: native passes or torch ops
    step: StepPlan
    speculation: SpeculationPlan | None

    def describe(self) -> dict[str, Any]:
        """The plan as JSON, for /v1/models and the start-up log."""
        out: dict[str, Any] = {
            "device": self.device, "machine": self.machine, "torch": self.torch_version,
            "activations": dtype_name(self.activations), "activations_reason": self.activations_reason,
            "kv_cache": {"dtype": dtype_name(self.kv.dtype), "reason": self.kv.reason, "source": self.kv.source},
            "attention": self.attention.describe(),
            "step": {"executor": self.step.executor, "deterministic": self.step.deterministic, "why": self.step.why},
            "kernels": self.kernels.describe() if self.kernels is not None else None,
            "elementwise": self.elementwise.describe(),
            "speculation": None,
        }
        if (spec := self.speculation) is not None:
            out["speculation"] = {"method": spec.method, "draft_row_cost": round(spec.row_cost, 4),
                                  "source": spec.source, "seconds": round(spec.seconds, 2),
                                  "curve": spec.curve.describe() if spec.curve is not None else None}
        return out

    def explain(self) -> list[str]:
        """Each choice, what decided it and where that came from, one line each."""
        d = self.describe()
        lines = [f"device {self.device} ({self.machine}), torch {self.torch_version}",
                 f"activations: {d['activations']} - {self.activations_reason}",
                 f"KV cache: {d['kv_cache']['dtype']} - {self.kv.reason} [{self.kv.source}]",
                 f"step: {self.step.executor}{', deterministic' if self.step.deterministic else ''} - {self.step.why}"]
        att = self.attention
        if isinstance(att, CpuAttentionPlan):
            route = "the native kernel" if att.kernel is not None else "the plain path (gather + SDPA)"
            lines.append(f"attention: {att.backend}; decodes, verifies and prompt spans take {route} - {att.why} "
                         "[capability]")
            if att.tiles is not None:
                lines.append(f"  tiles of {att.tiles.rows} prompt rows; us per {'/'.join(map(str, att.tiles.timings_us))}"
                             f" rows: {'/'.join(f'{us:.0f}' for us in att.tiles.timings_us.values())} [{att.tiles.source}]")
        else:
            lines.append(f"attention: {att.backend} - {att.why} [capability]")
        if self.kernels is not None:
            k = d["kernels"]
            lines.append(f"projections: prompt copies {k['prompt_copy_bytes']} bytes [{k['source']}]")
            for key, rows in k["rows"].items():
                lines.append(f"  {key}: {rows}")
            lines += [f"  self-check fallback: {line}" for line in k["self_check_fallbacks"]]
        else:
            lines.append("projections: dense weights (no kernel plan)")
        passes = "native passes" if self.elementwise.kernel is not None else "torch ops"
        lines.append(f"elementwise (norms with their adds, SiLU * up, RoPE): {passes} - {self.elementwise.why}")
        if (spec := self.speculation) is not None:
            lines.append(f"speculation: {spec.method}, each draft row adds {spec.row_cost:.3f} of a one-row step "
                         f"[{spec.source}{f', measured in {spec.seconds:.1f} s' if spec.seconds else ''}]")
            if spec.curve is not None:
                lines.append(f"  step ms by batch and draft rows: {spec.curve.describe()}")
        return lines
