"""The kernel plan reaches every quantized projection at construction, and nothing sets it afterwards:
the modules an engine runs hold the very LinearPlan its ExecutionPlan describes, no attribute of a built
projection is assigned while the engine is built, and the modules offer no setter to do it with."""

from __future__ import annotations

import dataclasses
import weakref
from pathlib import Path

import pytest
import torch
from torch import nn

from decodeservice.engine import Engine
from decodeservice.engine.model import MLP, Attention, RMSNorm
from decodeservice.engine.quant import Int4Linear, Int8Linear
from decodeservice.engine.quant.linear import LinearPlan, RowPlanned
from tests.engine.test_loader import write_tiny_gguf


def shape_key(name: str, module: RowPlanned) -> str:
    """kernel_plan.ProjectionShape.key, as read off a built module."""
    kind = type(module).__name__ + ("+w8a8" if module.has_w8a8 else "") + (" head" if name == "lm_head" else "")
    return f"{kind} {module.out_features}x{module.in_features}"


@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_each_projection_is_built_with_its_part_of_the_plan_and_never_set_after(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, quantization: str) -> None:
    monkeypatch.setenv("DECODESERVICE_KERNEL_CACHE", str(tmp_path / "kernels"))  # this plan reaches no other test
    # Projections whose construction has finished (RowPlanned._take_plan is its last step); weak, so that a
    # synthetic module the planner dropped does not lend its address to a module being built.
    built: weakref.WeakSet[RowPlanned] = weakref.WeakSet()
    late: list[tuple[weakref.ref[RowPlanned], str]] = []  # (projection, attribute) assigned once it was built
    take_plan = RowPlanned._take_plan

    def finish(self: RowPlanned, plan: LinearPlan) -> None:
        take_plan(self, plan)
        built.add(self)

    def recording_setattr(self: RowPlanned, name: str, value: object) -> None:
        if self in built and name != "training":  # model.eval() sets torch's own train/eval flag
            late.append((weakref.ref(self), name))
        nn.Module.__setattr__(self, name, value)

    monkeypatch.setattr(RowPlanned, "_take_plan", finish)
    monkeypatch.setattr(RowPlanned, "__setattr__", recording_setattr)
    path, _, _ = write_tiny_gguf(tmp_path / "t.gguf", tied=True)
    engine = Engine.from_pretrained(str(path), quantization=quantization, kv_cache_gib=0.01, w8a8=True)
    kernels = engine.plan.kernels
    assert kernels is not None and kernels is engine.model.kernel_plan
    projections = {name: m for name, m in engine.model.named_modules() if isinstance(m, RowPlanned)}
    assert projections and all(isinstance(m, Int4Linear if quantization == "int4" else Int8Linear)
                               for m in projections.values())
    # The planner's own synthetic modules build torch's packed copy at their kernel's first call (a cache
    # of their own): the model's projections are the ones nothing may touch.
    assert [(name, attribute) for name, m in projections.items() for ref, attribute in late if ref() is m] == []
    for name, module in projections.items():
        assert module in built
        assert module.plan is kernels.linears[shape_key(name, module)]  # the very object the plan describes
        assert module.w8a8_from == module.plan.w8a8_from
    described = engine.plan.describe()["kernels"]["rows"]
    assert set(described) == {shape_key(name, m) for name, m in projections.items()}
    # The elementwise passes: chosen once with the model (elementwise.plan_elementwise), held by the plan,
    # and every norm, MLP and attention module built with that very kernel (or None: the torch ops).
    passes = engine.plan.elementwise
    assert passes is engine.model.elementwise_plan and engine.plan.describe()["elementwise"]["native"] == (
        passes.kernel is not None)
    holders = [m for m in engine.model.modules() if isinstance(m, (RMSNorm, MLP, Attention))]
    assert holders and all(m.passes is passes.kernel for m in holders)
    # The recorder sees an assignment where there is one: the check above can fail.
    head = projections["lm_head"]
    late.clear()
    head.prompt_int8 = None
    assert [(ref(), attribute) for ref, attribute in late] == [(head, "prompt_int8")]


def test_the_plan_is_frozen_and_the_modules_offer_no_setter() -> None:
    plan = LinearPlan.default(w8a8=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.reference_only = True  # type: ignore[misc]
    for cls in (RowPlanned, Int4Linear, Int8Linear):
        own = [name for name in vars(cls) if not name.startswith("_")]
        assert not [name for name in own if name.startswith(("set_", "use_", "pack_", "release_"))], cls
        for name in ("plan", "w8a8_from", "int8_dot"):
            assert not isinstance(vars(cls).get(name), property) or vars(cls)[name].fset is None
    # Another plan is another module, on the same weights.
    module = Int8Linear(torch.randn(32, 64), dtype=torch.float32)
    other = module.with_plan(LinearPlan(w8a8_from=None, reference_only=True))
    assert other is not module and other.weight_int8 is module.weight_int8
    assert not module.plan.reference_only and other.plan.reference_only
