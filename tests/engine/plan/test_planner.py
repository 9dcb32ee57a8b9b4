"""engine/plan: the engine's one execution plan, built at start-up, handed to each component as it is
built, printed by `decodectl engine --explain-plan` and served in /v1/models."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from decodeservice.cli.main import main
from decodeservice.engine import SpeculativeConfig
from decodeservice.engine.attention import native_decode
from decodeservice.engine.attention.gather import GatherBackend
from decodeservice.engine.attention.paged_views import PagedViewsBackend
from decodeservice.engine.plan import CpuAttentionPlan, ExecutionPlan
from decodeservice.engine.plan.planner import build_backend, verify_row_cost
from decodeservice.engine.runner import ModelRunner
from tests.conftest import ModelBundle
from tests.engine.test_loader import write_tiny_gguf

CPU = torch.device("cpu")


def test_each_component_gets_its_part_of_the_plan_at_construction(tiny: ModelBundle) -> None:
    engine = tiny.engine(num_gpu_blocks_override=32)
    plan = engine.plan
    assert isinstance(plan, ExecutionPlan) and isinstance(plan.attention, CpuAttentionPlan)
    backend = engine.runner.attention_backend
    assert isinstance(backend, PagedViewsBackend)
    assert backend.kernel is plan.attention.kernel
    assert backend.kv_int8 is plan.attention.kv_int8 is False and engine.kv_dtype == plan.kv.dtype
    assert backend.tile_rows == plan.attention.tile_rows
    if plan.attention.kernel is not None:  # the tile height was timed (or read back) for this model's shape
        assert plan.attention.tiles is not None and plan.attention.tile_rows in plan.attention.tiles.timings_us
    assert plan.step.executor == "eager" and plan.kernels is None and plan.speculation is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.attention.kernel = None  # type: ignore[misc]
    described = plan.describe()
    assert described["kv_cache"]["dtype"] == "float32" and described["attention"]["backend"] == "paged_views"


def test_int8_pools_take_only_a_backend_planned_for_them(tiny: ModelBundle) -> None:
    """The runner no longer tells a backend about int8 pools after building it: it refuses one that was
    not built for them."""
    with pytest.raises(ValueError, match="planned for them"):
        ModelRunner(tiny.model, num_blocks=8, block_size=4, device=CPU, dtype=torch.float32, kv_dtype=torch.int8,
                    attention_backend=PagedViewsBackend())
    planned = CpuAttentionPlan(kernel=None, kv_int8=True, deterministic=False, why="test")
    runner = ModelRunner(tiny.model, num_blocks=8, block_size=4, device=CPU, dtype=torch.float32, kv_dtype=torch.int8,
                         attention=planned)
    assert isinstance(runner.attention_backend, PagedViewsBackend) and runner.attention_backend.kv_int8
    assert runner.attention_backend.kernel is None
    assert isinstance(ModelRunner(tiny.model, num_blocks=8, block_size=4, device=CPU, dtype=torch.float32,
                                  kv_dtype=torch.int8, attention_backend=GatherBackend()).attention_backend, GatherBackend)
    assert isinstance(build_backend(planned, num_blocks=8, block_size=4, device=CPU), PagedViewsBackend)


def test_a_measured_speculation_cost_is_in_the_plan(tiny: ModelBundle, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    native_decode.decode_extension()  # built (or loaded) where it is kept, before the cache moves for this test
    monkeypatch.setenv("DECODESERVICE_KERNEL_CACHE", str(tmp_path))
    engine = tiny.engine(num_gpu_blocks_override=96, speculative=SpeculativeConfig(method="ngram", num_tokens=2))
    spec = engine.plan.speculation
    assert spec is not None and spec.source == "measured now" and spec.curve is not None and spec.seconds > 0
    assert engine.spec is not None and engine.spec.row_cost == spec.row_cost
    # Kept beside the kernel plans: the next start reads it, names the file, and hands the decoder the same curve.
    [kept] = tmp_path.glob("spec-cost-*.json")
    again = tiny.engine(num_gpu_blocks_override=96, speculative=SpeculativeConfig(method="ngram", num_tokens=2))
    cached = again.plan.speculation
    assert cached is not None and cached.source == str(kept)
    assert cached.curve == spec.curve and cached.row_cost == spec.row_cost
    assert any(str(kept) in line for line in again.plan.explain())
    # Another measurement setting is another key, measured for itself.
    other = tiny.engine(num_gpu_blocks_override=96, speculative=SpeculativeConfig(method="ngram", num_tokens=3))
    assert other.plan.speculation is not None and other.plan.speculation.source == "measured now"
    assert len(list(tmp_path.glob("spec-cost-*.json"))) == 2
    configured = tiny.engine(num_gpu_blocks_override=96,
                             speculative=SpeculativeConfig(method="ngram", num_tokens=2, draft_row_cost=0.25))
    assert configured.plan.speculation is not None and configured.plan.speculation.source == "configured"
    assert any(line.startswith("speculation: ngram") for line in configured.plan.explain())
    cost = verify_row_cost(engine.runner, drafts=2, rounds=1)
    assert cost.plain_ms > 0 and 0.0 <= cost.row_cost < 1.0


def test_explain_plan_prints_the_plan_and_exits_without_serving(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    path, _, _ = write_tiny_gguf(tmp_path / "t.gguf", tied=True)
    # --port 1 would need root to listen: an engine that tried to serve would fail, not return 0
    assert main(["engine", "--model", str(path), "--kv-cache-gib", "0.01", "--port", "1", "--explain-plan"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("device cpu (")
    kinds = [line.split(":")[0] for line in out if not line.startswith("  ")]
    for kind in ("activations", "KV cache", "step", "attention", "projections"):
        assert kind in kinds, out
    assert any(line.startswith("attention: paged_views") and "[" in line for line in out)
