"""The one C++ kernel of the CPU path: the dense path's 4-bit dequantization (dequant_int4.cpp).

Why: a prompt chunk dequantizes every 4-bit matrix it runs dense, and torch's six elementwise passes
cost as much as the chunk's GEMM (native bf16: ~160 of ~600 ms of a 550-token prompt at 1 thread),
which also kept short chunks on the weight-only kernel, whose cost grows with rows. No stock op fuses
nibble unpacking with the group affine.

Built with torch.utils.cpp_extension at first use, for the ISA ATen dispatches to (so an AVX2-capped
run builds AVX2 code) and cached under the kernel cache; a build that fails (no compiler) or a kernel
that disagrees with the pure-torch path is logged and left out, and the torch path runs.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger("decodeservice.engine.kernels")

SOURCE = Path(__file__).with_name("dequant_int4.cpp")
# By ATen's dispatch level, never by the build machine: the cache key holds it, so a pod on another
# node type builds its own.
ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}
DISABLE_ENV = "DECODESERVICE_NATIVE_KERNELS"  # "0": torch paths only (an A/B baseline, or a broken toolchain)


def extension_dir() -> Path:
    root = os.environ.get("DECODESERVICE_KERNEL_CACHE") or Path.home() / ".cache" / "decodeservice" / "kernels"
    return Path(root) / "extensions"


@functools.cache
def dequant_extension() -> ModuleType | None:
    """The built extension, or None (disabled, no toolchain, or wrong results: logged)."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None
    capability = torch.backends.cpu.get_cpu_capability()
    flags = ISA_FLAGS.get(capability.split()[0], []) if sys.platform.startswith("linux") else []
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(flags).encode() + torch.__version__.encode()).hexdigest()
    name = f"decodeservice_dequant_{capability.lower()}_{digest[:12]}"
    build = extension_dir() / name
    started = time.perf_counter()
    try:
        from torch.utils.cpp_extension import load

        build.mkdir(parents=True, exist_ok=True)
        # torch runs `ninja` from PATH; a venv that is not activated has its ninja beside its python.
        os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
        module: ModuleType = load(name=name, sources=[str(SOURCE)], extra_cflags=["-O3", *flags],
                                  build_directory=str(build), verbose=False)
    except Exception as exc:  # any toolchain failure: compiler, headers, ninja, linker
        log.warning("no native dequantization kernel (%s: %s); the torch path runs", type(exc).__name__, exc)
        return None
    if not _agrees(module):
        log.warning("the native dequantization kernel disagrees with the torch path here; the torch path runs")
        return None
    log.info("native dequantization kernel ready (%s, %s, %.1f s)", capability, " ".join(flags) or "no ISA flags",
             time.perf_counter() - started)
    return module


def dequantize_int4(codes: torch.Tensor, scale_zeros: torch.Tensor, group: int, dtype: torch.dtype,
                    *, module: ModuleType) -> torch.Tensor:
    """(N, K/2) uint8 codes, (K/G, N', 2) bf16 scale and zero -> (N, K) `dtype`."""
    out = torch.empty(codes.shape[0], codes.shape[1] * 2, dtype=dtype)
    module.dequantize_int4(codes, scale_zeros, group, out)
    return out


def _agrees(module: ModuleType) -> bool:
    """The kernel against the same formula in torch, on random codes, every odd shape of the layout
    included (padded rows, two groups)."""
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 256, (37, 32), dtype=torch.uint8, generator=gen)  # K = 64: two groups of 32
    scale_zeros = torch.randn(2, 48, 2, generator=gen).to(torch.bfloat16)  # 48 >= 37 rows: padded
    nibbles = torch.stack([codes & 15, codes >> 4], dim=-1).flatten(-2).view(37, 2, 32).float()
    scale, zero = scale_zeros[:, :37].float().unbind(-1)  # (K/G, N)
    reference = ((nibbles - 8) * scale.t().unsqueeze(-1) + zero.t().unsqueeze(-1)).view(37, 64)
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        try:
            value = dequantize_int4(codes, scale_zeros, 32, dtype, module=module).float()
        except RuntimeError as exc:
            log.warning("native dequantization kernel failed its check: %s", exc)
            return False
        if not torch.allclose(value, reference.to(dtype).float(), rtol=tolerance, atol=tolerance):
            return False
    return True
