"""Weight quantization: which precision an engine runs at, and the modules that run it.

    precision = resolve_precision(config, source_has_int4=True)   # Precision(weights='int4', activations=bf16)

`quantization` is none | int8 | int4 | auto. auto takes the source's own precision where the kernels
here support it: a GGUF whose projections are Q4_0/Q4_1 runs int4 (loaded as 4-bit, never dequantized),
anything else runs unquantized. Quantized weights run on CPU with the activation dtype this CPU runs fast
(bf16 with native bf16, else fp32: kernel_plan.py); on CUDA the engine runs bf16 weights. Which path a
call takes by its row count (weight-only kernel, W8A8 where EngineConfig.w8a8 is on, dense GEMM) is
measured per machine at load (kernel_plan.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from decodeservice.engine.config import EngineConfig
from decodeservice.engine.errors import ConfigError
from decodeservice.engine.quant.cpu import CpuCapability, detect_cpu
from decodeservice.engine.quant.embedding import Int4Embedding, Int8Embedding
from decodeservice.engine.quant.int4 import Int4Weight, int4_from_gguf, quantize_int4
from decodeservice.engine.quant.kernel_plan import (
    ActivationChoice,
    KernelPlan,
    choose_activations,
    plan_kernels,
)
from decodeservice.engine.quant.linear import (
    Int4Linear,
    Int8Linear,
    int4_kernels_available,
    int8_kernels_available,
)
from decodeservice.engine.quant.w8a8 import W8A8_ROWS, quantize_int8, w8a8_mm

WeightFormat = Literal["none", "int8", "int4"]
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

__all__ = [
    "DTYPES",
    "ActivationChoice",
    "CpuCapability",
    "Int4Embedding",
    "Int4Linear",
    "Int4Weight",
    "Int8Embedding",
    "Int8Linear",
    "KernelPlan",
    "Precision",
    "W8A8_ROWS",
    "WeightFormat",
    "choose_activations",
    "detect_cpu",
    "int4_from_gguf",
    "plan_kernels",
    "quantize_int4",
    "quantize_int8",
    "resolve_precision",
    "w8a8_mm",
]


@dataclass(frozen=True, kw_only=True)
class Precision:
    weights: WeightFormat
    activations: torch.dtype  # also the KV cache's dtype
    reason: str = ""  # why these activations, where the machine decided it


def resolve_precision(config: EngineConfig, *, source_has_int4: bool, hidden_size: int = 0,
                      intermediate_size: int = 0) -> Precision:
    """What the engine runs at; a ConfigError at start-up for what this device cannot run. The sizes
    are the model's: quantized weights on CPU with dtype auto confirm bf16 against fp32 at its shape
    (0, unknown: at choose_activations' floor shape, never one model's)."""
    device = torch.device(config.device).type
    weights: WeightFormat
    if config.quantization == "auto":
        weights = "int4" if source_has_int4 and device == "cpu" and int4_kernels_available() else "none"
    else:
        weights = config.quantization
    if weights != "none":  # EngineConfig already refused a non-CPU device and non-bf16 activations
        if not (int4_kernels_available() if weights == "int4" else int8_kernels_available()):
            raise ConfigError(f"this torch build ({torch.__version__}) has no CPU {weights} weight kernels")
        if config.w8a8 and not hasattr(torch, "_int_mm"):
            raise ConfigError(f"this torch build ({torch.__version__}) has no int8 GEMM (torch._int_mm) for "
                              "w8a8; set w8a8 false")
        if config.dtype in ("bfloat16", "float32"):
            return Precision(weights=weights, activations=DTYPES[config.dtype], reason=f"dtype {config.dtype} was asked for")
        choice = choose_activations(detect_cpu(), hidden=hidden_size, intermediate=intermediate_size)
        return Precision(weights=weights, activations=choice.dtype, reason=choice.reason)
    if config.dtype == "auto":
        return Precision(weights="none", activations=torch.bfloat16 if device == "cuda" else torch.float32)
    return Precision(weights="none", activations=DTYPES[config.dtype])
