"""EngineConfig(compile=True): decode steps as one compiled graph (engine/compiled_step.py).

On a tiny int4 GGUF (the measured case): the compiled engine must decode the eager engine's greedy
tokens, alone and batched, and its forward must give the eager forward's logits bit for bit (inductor
emulates eager's bf16 roundings). Compiling the tiny model's graphs takes under a minute here."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from decodeservice.engine import Engine, EngineConfig, SamplingParams, compiled_step
from decodeservice.engine.errors import ConfigError
from decodeservice.engine.quant import kernel_plan, linear
from decodeservice.engine.quant.native import int4_dot_extension
from decodeservice.engine.quant.step_rows import StepRows
from decodeservice.engine.scheduler import ScheduledSequence
from tests.conftest import ModelBundle
from tests.engine.test_loader import Q, write_tiny_gguf

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                reason="torch.compile's CPU backend needs a C++ compiler, and none is on PATH")

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def int4_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    qtypes = {name: Q.Q4_1 for name in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                                        "ffn_down", "token_embd")}
    path, _, _ = write_tiny_gguf(tmp_path_factory.mktemp("compiled") / "t.gguf", tied=True, qtypes=qtypes)
    return path


@pytest.mark.parametrize("w8a8", [False, True])
def test_compiled_steps_equal_eager_bit_for_bit(int4_gguf: Path, w8a8: bool) -> None:
    compiled = Engine.from_pretrained(str(int4_gguf), quantization="int4", compile=True, kv_cache_gib=0.01,
                                      w8a8=w8a8)
    eager = Engine(model=compiled.model, tokenizer=compiled.tokenizer,
                   config=EngineConfig(quantization="int4", kv_cache_gib=0.01, w8a8=w8a8))
    assert compiled.runner.compiled is not None and eager.runner.compiled is None
    prompts = [compiled.tokenizer.encode(p) for p in (" the hell tell the", " tell the hell", " hell", " the")]
    for prompt in prompts[:2]:  # one stream: the one-row graph
        want = eager.generate([prompt], GREEDY)[0].token_ids
        assert compiled.generate([prompt], GREEDY)[0].token_ids == want
    # Two and four streams: the graph for a symbolic row count (with W8A8, rows from W8A8_ROWS on are a
    # third graph: the 4-stream steps stay under it, the warm-up's W8A8_ROWS-row step went over).
    for group in (prompts[:2], prompts):
        together = compiled.generate(group, GREEDY)
        assert [o.token_ids for o in together] == [o.token_ids for o in eager.generate(group, GREEDY)]
    assert compiled.prompt_tokens_total == 2 * sum(map(len, prompts[:2])) + sum(map(len, prompts))  # no warm-up

    # The same steps both ways, logits equal, for 1, 2 and 6 rows (W8A8_ROWS), twice: each step's metadata
    # is a new object that no guard may look at, so no step recompiles.
    ids = [compiled.add_request(prompt, GREEDY) for prompt in prompts + prompts[:2]]
    compiled.step()  # the prompts
    seqs = [compiled._requests[i] for i in ids]
    step = compiled.runner.compiled
    kv = compiled.runner.kv_caches
    with torch._dynamo.config.patch(error_on_recompile=True):
        for rows in (1, 2, 6, 1, 2, 6):
            assert all(compiled.kv.allocate_slots(seq, 1) for seq in seqs[:rows])
            batch, _ = compiled.runner.build_batch(
                [ScheduledSequence(seq=seq, num_new_tokens=1, num_spec_tokens=0) for seq in seqs[:rows]])
            assert step.applies_to(batch)
            got = compiled.model.compute_logits(step(batch, kv))
            assert torch.equal(got, compiled.model.compute_logits(compiled.model.forward(batch, kv))), rows
    with pytest.raises(LookupError):  # the step's context is gone after the call
        compiled_step._STEP.get()


def test_steps_with_prompt_rows_run_eager() -> None:
    # Short prompts and prefix-hit tails take the projections' prompt path: not the graphs warmed at start-up.
    decode = SimpleNamespace(input_ids=torch.zeros(3, dtype=torch.long), rows=StepRows())
    prompt = SimpleNamespace(input_ids=torch.zeros(3, dtype=torch.long), rows=StepRows(prompt_rows=torch.arange(3)))
    assert compiled_step.CompiledStep.applies_to(decode)  # type: ignore[arg-type]
    assert not compiled_step.CompiledStep.applies_to(prompt)  # type: ignore[arg-type]


def test_packed_fp32_weights_are_refused_at_start_up(tiny_factory: object) -> None:
    bundle: ModelBundle = tiny_factory(seed=11)  # type: ignore[operator]
    with pytest.raises(ConfigError, match="compile needs quantized weights"):
        bundle.engine(compile=True, kv_cache_gib=0.01)


def test_compile_is_cpu_only() -> None:
    with pytest.raises(ConfigError, match="compile runs on CPU only"):
        EngineConfig(compile=True, device="cuda")


def test_a_missing_cpp_compiler_is_refused_at_start_up(int4_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(ConfigError, match="compile needs a C[+][+] compiler"):
        Engine.from_pretrained(str(int4_gguf), quantization="int4", compile=True, kv_cache_gib=0.01)


def test_speculation_through_the_compiled_step_stays_lossless(int4_gguf: Path, caplog: pytest.LogCaptureFixture
                                                              ) -> None:
    # Verifies (1 + drafts rows) run the batch graph: the tokens must be plain decoding's, not merely close.
    caplog.set_level(logging.INFO, logger="decodeservice.engine.runner")
    spec = Engine.from_pretrained(str(int4_gguf), quantization="int4", compile=True, kv_cache_gib=0.01, w8a8=False,
                                  speculative={"method": "ngram", "num_tokens": 4, "draft_row_cost": 0.0})
    plain = Engine(model=spec.model, tokenizer=spec.tokenizer,
                   config=EngineConfig(quantization="int4", kv_cache_gib=0.01, w8a8=False))
    prompt = spec.tokenizer.encode(" the hell tell the hell tell the hell tell the")
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    assert spec.generate([prompt], params)[0].token_ids == plain.generate([prompt], params)[0].token_ids
    assert spec.spec is not None and spec.spec.num_draft_tokens > 0  # verifies did run
    # A start-up that compiles for minutes says so in the log (a pod not Ready yet should not look hung).
    runner_records = [r for r in caplog.records if r.name == "decodeservice.engine.runner"]  # not the kernel plan's
    assert [r.message.split(" (")[0] for r in runner_records][:1] == ["compiling the decode step"]
    assert "decode step compiled in" in caplog.text


def test_the_int8_dot_kernel_traces_into_the_compiled_step(int4_gguf: Path, monkeypatch: pytest.MonkeyPatch,
                                                           tmp_path: Path) -> None:
    """Where the kernel plan gives projections the native int8-dot kernel (the bundled model's, on most
    CPUs), the fullgraph compile calls it as a custom op, and the step stays bit-identical to eager."""
    if int4_dot_extension() is None:
        pytest.skip("the int8-dot kernel needs AVX2 (ATen dispatches below it here)")
    monkeypatch.setenv("DECODESERVICE_KERNEL_CACHE", str(tmp_path))  # this plan must not reach other tests
    monkeypatch.setattr(linear, "DOT_MIN_WEIGHTS", 0)  # the tiny model's matrices: timing them means nothing,
    monkeypatch.setattr(kernel_plan, "_dot_wins", lambda module, dot: True)  # so the kernel is chosen outright
    compiled = Engine.from_pretrained(str(int4_gguf), quantization="int4", compile=True, kv_cache_gib=0.01, w8a8=False)
    eager = Engine(model=compiled.model, tokenizer=compiled.tokenizer,
                   config=EngineConfig(quantization="int4", kv_cache_gib=0.01, w8a8=False))
    assert compiled.runner.compiled is not None
    fits = [m for m in compiled.model.modules() if isinstance(m, linear.Int4Linear) and m.int8_dot_fits]
    assert len(fits) == 8 and all(m.int8_dot is not None for m in fits)  # every projection; the head's 264 rows do not fit
    prompts = [compiled.tokenizer.encode(p) for p in (" the hell tell the", " tell the hell")]
    for group in (prompts[:1], prompts):  # the one-row graph, then the batch graph
        assert ([o.token_ids for o in compiled.generate(group, GREEDY)]
                == [o.token_ids for o in eager.generate(group, GREEDY)])
