"""What this CPU can do, read from the machine, never assumed from the one the code was tuned on.

Two facts decide the CPU path (engine/quant/kernel_plan.py):
- native bf16 (AVX512_BF16 or AMX-BF16, with ATen and oneDNN allowed to use them): without it a bf16
  GEMM is emulated, about 10x slower than fp32 at prompt-chunk sizes (kernel_plan.py measures it at
  start-up and logs both times), and bf16 attention slower too;
- the ISA ATen dispatches to (`ATEN_CPU_CAPABILITY` lowers it), which also decides how torch packs
  the int4 kernel's weights.

`ATEN_CPU_CAPABILITY=avx2` with `ONEDNN_MAX_CPU_ISA=AVX2` and `MKL_ENABLE_INSTRUCTIONS=AVX2` makes an
AVX-512 machine take the AVX2 paths of all three libraries, which is how the test suite covers CPUs
without AVX-512 on either kind. Without the MKL cap, torch's fp32 GEMMs on unpacked weights (HF
transformers', and the dense path's) keep AVX-512 and flatter an emulated run.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

# The flags that change a kernel choice; the rest of /proc/cpuinfo's list does not enter the cache key.
RELEVANT_FLAGS = frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni", "avx_vnni",
                            "amx_tile", "amx_bf16", "amx_int8", "asimd", "bf16", "i8mm", "sve"})
_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})  # x86 (AVX-512/AMX) and aarch64 (FEAT_BF16)
_INT8_DOT_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8", "i8mm"})


@dataclass(frozen=True, kw_only=True)
class CpuCapability:
    model_name: str  # e.g. "AMD EPYC 7B13"
    aten: str  # the ISA ATen dispatches to: "AVX512", "AVX2", "DEFAULT", ...
    onednn_max_isa: str | None  # ONEDNN_MAX_CPU_ISA, where a user (or the tests) capped oneDNN
    # MKL_ENABLE_INSTRUCTIONS: MKL (torch's fp32 GEMM for unpacked weights) has its own dispatch, which
    # the two caps above do not lower; it changes timings, hence the kernel plans' cache key.
    mkl_instructions: str | None = None
    flags: frozenset[str]  # the relevant ones the CPU reports

    @property
    def native_bf16(self) -> bool:
        """bf16 arithmetic in hardware, usable by both ATen and oneDNN as this process is set up."""
        if not self.flags & _BF16_FLAGS:
            return False
        if self.aten.startswith("AVX2") or self.aten == "DEFAULT":
            return False  # ATen capped below AVX-512 (or never had it): its bf16 ops are emulated
        cap = (self.onednn_max_isa or "ALL").upper()
        return cap == "ALL" or any(word in cap for word in ("BF16", "AMX", "FP16", "AVX10"))

    @property
    def int8_dot(self) -> bool:
        """An int8 dot-product instruction (VNNI, AMX-INT8, i8mm): what makes W8A8 GEMMs fast."""
        return bool(self.flags & _INT8_DOT_FLAGS)

    def describe(self) -> str:
        cap = f", oneDNN capped at {self.onednn_max_isa}" if self.onednn_max_isa else ""
        cap += f", MKL capped at {self.mkl_instructions}" if self.mkl_instructions else ""
        return (f"{self.model_name} (ATen {self.aten}{cap}; native bf16: {'yes' if self.native_bf16 else 'no'}; "
                f"int8 dot: {'yes' if self.int8_dot else 'no'}; flags {' '.join(sorted(self.flags)) or 'none'})")


def detect_cpu(cpuinfo: Path = Path("/proc/cpuinfo")) -> CpuCapability:
    model_name, flags = platform.processor() or platform.machine(), frozenset[str]()
    if cpuinfo.exists():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            key = key.strip().lower()
            if key in ("model name", "cpu model") and model_name in ("", platform.processor(), platform.machine()):
                model_name = value.strip()
            elif key in ("flags", "features") and not flags:
                flags = frozenset(value.split()) & RELEVANT_FLAGS
    return CpuCapability(model_name=model_name or "unknown", aten=torch.backends.cpu.get_cpu_capability(),
                         onednn_max_isa=os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA"),
                         mkl_instructions=os.environ.get("MKL_ENABLE_INSTRUCTIONS"), flags=flags)


@functools.cache
def int8_gemm_is_exact() -> bool:
    """Does torch._int_mm return the exact int32 product here? oneDNN's AVX2 path without VNNI sums
    u8 x s8 pairs in saturating int16 (vpmaddubsw): measured off by up to ~66k on sums of 256 products
    under ONEDNN_MAX_CPU_ISA=AVX2, exact with AVX2-VNNI, AVX-512-VNNI or AMX. W8A8 needs it exact."""
    if not hasattr(torch, "_int_mm"):
        return False
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(-127, 128, (32, 256), dtype=torch.int8, generator=gen)
    b = torch.randint(-127, 128, (64, 256), dtype=torch.int8, generator=gen)
    a[:, :8], b[:, :8] = 127, 127  # the extremes that saturate a 16-bit pair sum
    return bool(torch.equal(torch._int_mm(a, b.t()).long(), a.long() @ b.long().t()))
