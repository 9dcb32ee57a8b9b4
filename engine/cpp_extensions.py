"""The engine's C++ kernels (engine/quant/int4_dot.cpp, the attention kernels), built
with torch.utils.cpp_extension at first use and cached.

Each is built for the ISA ATen dispatches to, never for the build machine: an AVX2-capped run
(`ATEN_CPU_CAPABILITY=avx2`, as scripts/test.sh runs the quantized tests) builds AVX2 code, and the
cache key holds the ISA flags, the source and torch's version, so a pod on another node type builds its
own. AVX-512 builds add VNNI only where the CPU reports it (/proc/cpuinfo's avx512_vnni).
A build that fails (no compiler) or a kernel that fails its check against the torch path is logged
and left out: the torch path runs.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger("decodeservice.engine.kernels")

ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}
DISABLE_ENV = "DECODESERVICE_NATIVE_KERNELS"  # "0": torch paths only (an A/B baseline, or a broken toolchain)


def extension_dir() -> Path:
    root = os.environ.get("DECODESERVICE_KERNEL_CACHE") or Path.home() / ".cache" / "decodeservice" / "kernels"
    return Path(root) / "extensions"


def openmp_flags() -> list[str]:
    """-fopenmp where ATen parallelizes with OpenMP: at::parallel_for is a header-only `#pragma omp` loop
    there, so without the flag a kernel's parallel_for silently runs on one thread (measured: the int8-dot
    kernel took the same time at 2 threads as at 1). The extension's libgomp.so.1 is the one torch has
    already loaded (the same soname), so there is one OpenMP runtime and one thread pool."""
    if not sys.platform.startswith("linux") or "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return []
    return ["-fopenmp"]


@contextlib.contextmanager
def exclusive_build(build: Path) -> Iterator[None]:
    """Hold `build` for one process at a time with a kernel lock, which dies with its holder.

    torch's own guard is a `lock` file created in the build directory and removed when the build ends;
    a process killed mid-build (a server stopped during start-up, a job past its deadline) leaves it
    behind, and every later build of that kernel waits on it forever. Every builder takes this lock
    first, so a `lock` file found while holding it belongs to no live build and is removed."""
    with open(build / "build.flock", "a") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX)
        try:
            stale = build / "lock"
            if stale.exists():
                log.warning("removing %s, left by a build that did not finish", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(holder, fcntl.LOCK_UN)


def build_extension(source: Path, *, what: str, check: Callable[[ModuleType], bool],
                    x86_intrinsics: bool = False, headers: Sequence[Path] = ()) -> ModuleType | None:
    """`source` built (or loaded from the cache) and checked; None where it is off, fails to build or
    fails `check`, each logged. `x86_intrinsics`: the source needs AVX2 and FMA, so it is built only
    where ATen dispatches to AVX2 or AVX-512. `headers`: what the source includes from beside it, part
    of the cache key (a changed header must not load the old build)."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None
    capability = torch.backends.cpu.get_cpu_capability()
    flags = ISA_FLAGS.get(capability.split()[0], []) if sys.platform.startswith("linux") else []
    from decodeservice.engine.quant import cpu  # here: quant's kernels import this module at their import

    if flags and capability.startswith("AVX512") and "avx512_vnni" in cpu.detect_cpu().flags:
        flags = [*flags, "-mavx512vnni"]  # the int8-dot kernel's 4-term dot; only where the CPU has it
    if x86_intrinsics and not flags:
        log.info("no native %s kernel: it needs AVX2 (ATen dispatches to %s here)", what, capability)
        return None
    threading = openmp_flags()
    code = source.read_bytes() + b"".join(header.read_bytes() for header in headers)
    digest = hashlib.sha256(code + " ".join([*flags, *threading]).encode() +
                            torch.__version__.encode()).hexdigest()
    name = f"decodeservice_{source.stem}_{capability.lower()}_{digest[:12]}"
    build = extension_dir() / name
    started = time.perf_counter()
    try:
        from torch.utils.cpp_extension import load

        build.mkdir(parents=True, exist_ok=True)
        # torch runs `ninja` from PATH; a venv that is not activated has its ninja beside its python.
        os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
        with exclusive_build(build):
            module: ModuleType = load(name=name, sources=[str(source)],
                                      extra_cflags=["-O3", *flags, *threading], extra_ldflags=threading,
                                      build_directory=str(build), verbose=False)
    except Exception as exc:  # any toolchain failure: compiler, headers, ninja, linker
        log.warning("no native %s kernel (%s: %s); the torch path runs", what, type(exc).__name__, exc)
        return None
    try:
        agrees = check(module)
    except RuntimeError as exc:
        log.warning("the native %s kernel failed its check (%s); the torch path runs", what, exc)
        return None
    if not agrees:
        log.warning("the native %s kernel disagrees with the torch path here; the torch path runs", what)
        return None
    log.info("native %s kernel ready (%s, %s, %.1f s)", what, capability, " ".join(flags) or "no ISA flags",
             time.perf_counter() - started)
    return module
