"""Where start-up measurements are kept between restarts: the kernel plan's (kernel_plan.py), the bf16
verdict, the speculation cost (spec_decode/cost.py). One JSON file per measurement and identity, the
identity being everything the figures depend on: the plan's layout version, the engine's C++ kernels'
sources, the CPU model, ISA caps, thread count, torch version, dtype and the shapes measured. `$DECODESERVICE_KERNEL_CACHE`, else
~/.cache/decodeservice/kernels.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from decodeservice.engine.quant.cpu import CpuCapability

log = logging.getLogger("decodeservice.engine.kernels")
T = TypeVar("T")

# 3: dense thresholds as measured (the floor for mixed steps at the call); 4: native dequant; 5: int8 dot;
# 6: the int8-dot kernel on its own tiles (VNNI where the CPU has it); 7: it takes fp32 rows as they are;
# 8: prompt rows on a packed dense copy where faster (prompt_weights.py); 9: timings' min over 20 ms of runs
# (version 8's plans were measured with 5 runs: a loaded machine's cached one took torch's int4 kernel over the
# int8-dot kernel for q/k/v and gate/up); 10: prompt rows on an int8 copy where the CPU's int8 GEMM is exact
# and it beat the packed dense copy (prompt_weights.Int8Copy); 11: that int8 copy only under `--w8a8`;
# 12: no dense path and no native dequantization (they lost to the weight-only kernel at every row count on
# both dispatches: benchmarks/results/route_audit_dense_path.json), so no dense thresholds in the plan
# 13: the int8-dot kernel's vectorized quantization and row split (its results moved by a sum's rounding,
# and it now beats the packed copies at prompt sizes: a plan measured before would keep those copies)
PLAN_VERSION = 13


@functools.cache
def kernel_sources_digest() -> str:
    """The engine's C++ kernels (the int8-dot GEMM, the paged attention kernel), hashed: a plan timed on one
    build of them says nothing about another, so a changed kernel is measured again without a version bump."""
    engine = Path(__file__).resolve().parent.parent
    sources = sorted([*engine.rglob("*.cpp"), *engine.rglob("*.h")])
    digest = hashlib.sha256()
    for source in sources:
        digest.update(source.relative_to(engine).as_posix().encode() + b"\0" + source.read_bytes())
    return digest.hexdigest()[:20]


def plan_cache_path(cache_dir: Path | None, cpu: CpuCapability, dtype: torch.dtype, keys: list[str], *,
                    prefix: str = "plan") -> Path:
    identity = {"version": PLAN_VERSION, "kernels": kernel_sources_digest(), "cpu": cpu.model_name, "aten": cpu.aten, "onednn": cpu.onednn_max_isa,
                "mkl": cpu.mkl_instructions, "flags": sorted(cpu.flags), "threads": torch.get_num_threads(),
                "torch": torch.__version__, "activations": str(dtype), "shapes": keys}
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:20]
    root = cache_dir or Path(os.environ.get("DECODESERVICE_KERNEL_CACHE") or
                             Path.home() / ".cache" / "decodeservice" / "kernels")
    return root / f"{prefix}-{digest}.json"


def read_cached(path: Path, parse: Callable[[Any], T]) -> T | None:
    """`parse` of the JSON at `path`; None where there is none yet, or where it is torn or from an older
    layout (logged): then the caller measures again."""
    try:
        return parse(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("ignoring cached kernel choice %s: %s", path, exc)
        return None


def write_cached(path: Path, value: dict[str, Any]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(value, indent=1))
        tmp.replace(path)  # atomic: pods sharing a cache volume never read half a file
    except OSError as exc:  # a read-only home in a pod: the choice still applies, it is just not kept
        log.warning("could not cache the kernel choice at %s: %s", path, exc)
