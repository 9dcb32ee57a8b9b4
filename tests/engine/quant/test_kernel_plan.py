"""engine/quant/cpu.py and kernel_plan.py: the CPU's capabilities as read, the activation choice, the
measured routes and their cache, and the load-time self-check that refuses a wrong fast path.

The whole file also runs under the AVX2 caps of scripts/test.sh (ATen, oneDNN, MKL), where
torch packs the int4 kernel's weights in its AVX2 layout and bf16 is not native."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from decodeservice.engine.quant import Int4Linear, Int8Linear, plan_cache, quantize_int4
from decodeservice.engine.quant.cpu import CpuCapability, detect_cpu, int8_gemm_is_exact
from decodeservice.engine.quant.kernel_plan import (
    ActivationChoice,
    KernelPlan,
    ProjectionShape,
    choose_activations,
    plan_kernels,
)
from decodeservice.engine.quant.kernel_race import first_win
from decodeservice.engine.quant.linear import LinearPlan
from decodeservice.engine.quant.self_check import self_check

# Flags as /proc/cpuinfo prints them on the two kinds of machine this project runs on (abridged).
AMD_AVX2 = ("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 7B13\n"
            "flags\t\t: fpu sse sse2 avx fma avx2 bmi2 sha_ni\n")
INTEL_AMX = ("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8481C\n"
             "flags\t\t: avx2 fma avx512f avx512bw avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8\n")


def cpu(flags: str, *, aten: str = "AVX512", onednn: str | None = None) -> CpuCapability:
    return CpuCapability(model_name="test", aten=aten, onednn_max_isa=onednn, flags=frozenset(flags.split()))


def test_cpuinfo_is_read_for_model_and_relevant_flags(tmp_path: Path) -> None:
    (tmp_path / "amd").write_text(AMD_AVX2)
    (tmp_path / "intel").write_text(INTEL_AMX)
    amd, intel = detect_cpu(tmp_path / "amd"), detect_cpu(tmp_path / "intel")
    assert amd.model_name == "AMD EPYC 7B13" and amd.flags == {"avx2", "fma"}  # sha_ni etc. are not kernel facts
    assert intel.flags >= {"avx512_bf16", "amx_bf16", "amx_int8"}
    assert not amd.native_bf16 and not amd.int8_dot
    assert intel.int8_dot
    assert detect_cpu(tmp_path / "missing").model_name  # no /proc/cpuinfo (macOS): still a capability


def test_native_bf16_needs_the_flag_and_both_libraries_allowed_to_use_it() -> None:
    assert cpu("avx2 avx512f avx512_bf16").native_bf16
    assert cpu("avx2 amx_bf16 amx_tile").native_bf16
    assert not cpu("avx2 avx512f").native_bf16  # AVX-512 without BF16 (Skylake, Zen 4 has it)
    assert not cpu("avx2 avx512_bf16", aten="AVX2").native_bf16  # ATEN_CPU_CAPABILITY=avx2
    assert not cpu("avx2 avx512_bf16", onednn="AVX2").native_bf16  # ONEDNN_MAX_CPU_ISA=AVX2
    assert cpu("avx2 avx512_bf16", onednn="AVX512_CORE_BF16").native_bf16


def test_without_native_bf16_activations_are_fp32() -> None:
    choice = choose_activations(cpu("avx2 fma"), hidden=64, intermediate=128)
    assert choice.dtype == torch.float32 and "no native bf16" in choice.reason


def test_the_bf16_verdict_is_measured_once_per_machine_then_read_back(tmp_path: Path) -> None:
    native = cpu("avx2 avx512f avx512_bf16 amx_bf16 amx_tile")
    first = choose_activations(native, hidden=64, intermediate=128, cache_dir=tmp_path)
    assert "cached" not in first.reason and len(list(tmp_path.glob("activations-*.json"))) == 1
    again = choose_activations(native, hidden=64, intermediate=128, cache_dir=tmp_path)
    assert again.dtype == first.dtype and "cached" in again.reason
    # another CPU (here: MKL capped) is another key, so it measures for itself
    capped = dataclasses.replace(native, mkl_instructions="AVX2")
    assert "cached" not in choose_activations(capped, hidden=64, intermediate=128, cache_dir=tmp_path).reason


def test_the_first_win_is_the_start_of_the_last_winning_run() -> None:
    incumbent = {16: 1.0, 32: 2.0, 64: 4.0, 128: 8.0}
    assert first_win({16: 2.0, 32: 1.0, 64: 3.0, 128: 5.0}, incumbent) == 32
    assert first_win({16: 0.5, 32: 3.0, 64: 3.0, 128: 5.0}, incumbent) == 64  # a noisy early win does not count
    assert first_win({16: 2.0, 32: 3.0, 64: 5.0, 128: 9.0}, incumbent) is None


def gaussian(rows: int, cols: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


def reference(module: Int4Linear | Int8Linear, x: torch.Tensor) -> torch.Tensor:
    return x.float() @ module.dense_weight(torch.float32).t()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_self_check_passes_the_kernels_of_this_machine(dtype: torch.dtype) -> None:
    for module in (Int4Linear(quantize_int4(gaussian(200, 128, 0)), dtype=dtype, w8a8=True),
                   Int8Linear(gaussian(200, 128, 1), dtype=dtype, w8a8=True)):
        assert self_check("m", module, dtype=dtype) == ([], module.plan)
        assert not module.plan.reference_only and module.w8a8_from is not None


def test_self_check_refuses_a_kernel_layout_it_misreads_and_falls_back_to_the_reference() -> None:
    """What broke on AVX2: code that assumed the AVX-512 packing. Here the kernel's packed bytes are
    scrambled (a layout the kernel does not expect); the check must notice and route every call to
    the reference on our own codes, which stays right."""
    module = Int4Linear(quantize_int4(gaussian(128, 128, 2)), dtype=torch.float32)
    module.packed = module.torch_packing().flip(0).contiguous()
    failed, checked = self_check("layers.0.mlp.down_proj", module, dtype=torch.float32)
    assert len(failed) == 1 and "weight-only kernel off" in failed[0] and "layers.0.mlp.down_proj" in failed[0]
    assert checked.reference_only
    module = module.with_plan(checked)  # the same scrambled copy, built with the checked plan
    x = gaussian(1, 128, 3)
    torch.testing.assert_close(module(x), reference(module, x), rtol=1e-5, atol=1e-4)


def test_self_check_turns_off_a_wrong_w8a8_copy() -> None:
    module = Int4Linear(quantize_int4(gaussian(128, 128, 4)), dtype=torch.bfloat16, w8a8=True)
    assert module.w8a8_scales is not None
    module.w8a8_scales = module.w8a8_scales.flip(0).contiguous()  # scales of the wrong channels
    failed, checked = self_check("lm_head", module, dtype=torch.bfloat16)
    assert failed == [failed[0]] and "W8A8 off" in failed[0]
    assert checked.w8a8_from is None and module.with_plan(checked).w8a8_from is None


INT4_192x64 = ProjectionShape(int4=True, out_features=192, in_features=64, group_size=32, w8a8=False, head=False)
INT8_HEAD = ProjectionShape(int4=False, out_features=320, in_features=64, group_size=0, w8a8=True, head=True)
TWO_LAYERS = [INT4_192x64, INT4_192x64, INT8_HEAD]  # a and b of the same shape: one measure


class TwoLayers(torch.nn.Module):
    """Built as the loader builds a model: every module with its part of a plan made before it."""

    def __init__(self, plan: KernelPlan) -> None:
        super().__init__()
        self.a = Int4Linear(quantize_int4(gaussian(192, 64, 5)), dtype=torch.float32, plan=plan.linear(INT4_192x64))
        self.b = Int4Linear(quantize_int4(gaussian(192, 64, 6)), dtype=torch.float32, plan=plan.linear(INT4_192x64))
        self.lm_head = Int8Linear(gaussian(320, 64, 7), dtype=torch.float32, w8a8=True, plan=plan.linear(INT8_HEAD))


def test_plan_measures_each_shape_once_caches_it_and_sets_every_module(tmp_path: Path) -> None:
    fp32 = ActivationChoice(dtype=torch.float32, reason="test")
    plan = plan_kernels(TWO_LAYERS, activations=fp32, cache_dir=tmp_path)
    model = TwoLayers(plan)
    assert plan.source == "measured"
    assert all("torch._int_mm is not exact" in line for line in plan.fallbacks)  # only where it is not (AVX2)
    assert set(plan.shapes) == {"Int4Linear 192x64", "Int8Linear+w8a8 head 320x64"}
    int4 = plan.shapes["Int4Linear 192x64"]
    # prompt chunks against a packed dense copy too, where oneDNN has one (prompt_weights.py)
    assert set(int4.timings_ms) <= {"prompt_prompt_path", "prompt_packed", "prompt_int8_best", "prompt_int8_int8"}
    assert all(ms > 0 for rungs in int4.timings_ms.values() for ms in rungs.values())
    copies = [m for m in (model.a, model.b) if m.prompt_weight is not None]
    assert (len(copies) == 2) == int4.prompt_packed  # the memory rule takes all of a small model's copies
    assert plan.prompt_copy_bytes == sum(m.out_features * m.in_features * 4 for m in copies)  # fp32 copies
    assert model.lm_head.prompt_weight is None  # the head never sees a prompt chunk
    assert "w8a8" in plan.shapes["Int8Linear+w8a8 head 320x64"].timings_ms
    assert model.a.plan == model.b.plan == plan.linear(INT4_192x64)
    described = plan.describe()
    json.dumps(described)  # what /v1/models serves
    rows = described["rows"]["Int4Linear 192x64"]
    assert described["activations"] == "float32" and rows["w8a8_from"] == int4.w8a8_from
    assert rows["prompt_packed"] == int4.prompt_packed
    # A second load reads the cache (no measurement), and still self-checks.
    (cached_file,) = tmp_path.glob("plan-*.json")
    again = plan_kernels(TWO_LAYERS, activations=fp32, cache_dir=tmp_path)
    assert again.source == str(cached_file) and again.shapes == plan.shapes
    # A torn file is measured again, not trusted.
    cached_file.write_text("{not json")
    assert plan_kernels(TWO_LAYERS, activations=fp32, cache_dir=tmp_path).source == "measured"


def test_plan_cache_is_keyed_by_the_machine(tmp_path: Path) -> None:
    fp32 = ActivationChoice(dtype=torch.float32, reason="test")
    plan_kernels(TWO_LAYERS, activations=fp32, cache_dir=tmp_path, cpu=cpu("avx2 fma", aten="AVX2"))
    plan_kernels(TWO_LAYERS, activations=fp32, cache_dir=tmp_path, cpu=cpu("avx2 avx512_bf16"))
    assert len(list(tmp_path.glob("plan-*.json"))) == 2


def test_plan_cache_is_keyed_by_the_kernels_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan timed on one build of the C++ kernels is not read back for another build."""
    fp32 = ActivationChoice(dtype=torch.float32, reason="test")
    plan_kernels(TWO_LAYERS, activations=fp32, cache_dir=tmp_path)
    monkeypatch.setattr(plan_cache, "kernel_sources_digest", lambda: "another build")
    assert plan_kernels(TWO_LAYERS, activations=fp32, cache_dir=tmp_path).source == "measured"
    assert len(list(tmp_path.glob("plan-*.json"))) == 2


def test_w8a8_runs_only_where_the_int8_gemm_is_exact(tmp_path: Path) -> None:
    """On plain AVX2 (no VNNI) oneDNN's int8 GEMM saturates 16-bit pair sums: the plan must not run
    W8A8 there. This file runs on both kinds (scripts/test.sh), so both branches are exercised."""
    plan = plan_kernels(TWO_LAYERS, activations=ActivationChoice(dtype=torch.float32, reason="test"), cache_dir=tmp_path)
    model = TwoLayers(plan)
    if int8_gemm_is_exact():  # W8A8 then runs from wherever it measured faster (at tiny shapes: maybe nowhere)
        assert model.lm_head.w8a8_from == plan.shapes["Int8Linear+w8a8 head 320x64"].w8a8_from
        assert not any("torch._int_mm is not exact" in line for line in plan.fallbacks)
    else:
        assert model.lm_head.w8a8_from is None
        assert any("torch._int_mm is not exact" in line for line in plan.fallbacks)


def test_the_reference_takes_every_call_where_the_kernel_failed_its_self_check() -> None:
    """A plan whose weight-only kernel failed its self-check: decode rows and prompt rows alike take the
    reference, a GEMM on the weights dequantized from the project's own codes (prompt rows ROW_TILE-padded)."""
    from decodeservice.engine.quant.linear import StepRows

    module = Int4Linear(quantize_int4(gaussian(192, 64, 8)), dtype=torch.float32,
                        plan=LinearPlan(w8a8_from=None, reference_only=True))
    x = gaussian(20, 64, 9)
    weight = module.dense_weight(torch.float32)
    assert not torch.equal(module.weight_only(x.to(torch.bfloat16)).float(), F.linear(x, weight))  # told apart
    assert torch.equal(module(x[:1]), F.linear(x[:1], weight))
    prompt = StepRows(prompt_rows=torch.arange(20))
    padded = torch.cat([x, x.new_zeros(12, 64)])
    assert torch.equal(module(x, prompt), F.linear(padded, weight)[:20])


def test_the_runner_hands_each_step_its_rows(tmp_path: Path) -> None:
    """What the runner tells the modules, step by step, on a tiny int4 model."""
    from decodeservice.engine import Engine, SamplingParams
    from decodeservice.engine.model import ForwardBatch
    from decodeservice.engine.quant.linear import StepRows
    from decodeservice.engine.scheduler import ScheduledSequence
    from tests.engine.test_loader import write_tiny_gguf

    path, _, _ = write_tiny_gguf(tmp_path / "t.gguf", tied=True)
    engine = Engine.from_pretrained(str(path), quantization="int4", kv_cache_gib=0.01, max_num_batched_tokens=16)
    told: list[StepRows] = []
    build_batch = engine.runner.build_batch

    def recording(scheduled: list[ScheduledSequence]) -> tuple[ForwardBatch, list[int]]:
        batch, row_counts = build_batch(scheduled)
        told.append(batch.rows)  # the step's own rows, handed down its forward
        return batch, row_counts

    engine.runner.build_batch = recording  # type: ignore[method-assign]
    engine.generate([[3, 4, 5, 6, 7] * 8], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    # 40 prompt tokens in chunks of 16: three prompt-only steps (the last, of 8 rows, samples the first
    # token), then two decode steps
    assert [None if rows.prompt_rows is None else rows.prompt_rows.shape[0] for rows in told] == [16, 16, 8, None, None]
    assert all(rows.other_rows is None and not rows.deterministic for rows in told)
