"""Where the engine keeps what it measures and builds per machine type: the kernel cache.

The engine's kernel choices, speculation cost curve and native kernels (engine/quant/kernel_plan.py,
engine/spec_decode/cost.py, engine/cpp_extensions.py) are keyed by the CPU's identity (model, ISA flags,
threads, torch), so pods on the same machine type can share them and pods on another never load the wrong
ones. By default they go to the cache emptyDir, which outlives a container restart; where the model cache
is a PVC the pods share (spec.model.cache.claimName), to a folder of their own on it, mounted writable
(the model files beside it are read-only), so a second replica on the same machine type starts without
measuring again.
"""

from __future__ import annotations

from typing import Any

from decodeservice.operator.engines import CACHE_DIR, ModelPlan

KERNEL_CACHE_ENV = "DECODESERVICE_KERNEL_CACHE"
SHARED_KERNEL_CACHE_DIR = "/kernel-cache"
SHARED_KERNEL_SUBPATH = "decodeservice-kernels"


def shared_kernel_cache(plan: ModelPlan) -> bool:
    """True where the model cache is a PVC the pods share (spec.model.cache.claimName)."""
    return any(vol["name"] == "model-cache" and "persistentVolumeClaim" in vol for vol in plan.volumes)


def kernel_cache_dir(plan: ModelPlan) -> str:
    return SHARED_KERNEL_CACHE_DIR if shared_kernel_cache(plan) else f"{CACHE_DIR}/kernels"


def kernel_cache_mounts(plan: ModelPlan) -> list[dict[str, Any]]:
    """The engine container's extra mount: the claim's kernel folder, where there is a claim."""
    if not shared_kernel_cache(plan):
        return []
    return [{"name": "model-cache", "mountPath": SHARED_KERNEL_CACHE_DIR, "subPath": SHARED_KERNEL_SUBPATH}]
