"""engine/quant/w8a8: int8 activations x int8 weights for batches, checked against float64 references,
and on the bundled model against the same prompts decoded alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from decodeservice.cli.engine_cmd import engine_kwargs
from decodeservice.cli.main import build_parser
from decodeservice.engine import Engine, EngineConfig, SamplingParams
from decodeservice.engine.engine import build_model
from decodeservice.engine.errors import ConfigError
from decodeservice.engine.loader import load_model
from decodeservice.engine.quant import (
    W8A8_ROWS,
    Int4Linear,
    Int8Linear,
    quantize_int4,
    quantize_int8,
    w8a8_mm,
)
from decodeservice.engine.quant.cpu import int8_gemm_is_exact
from decodeservice.engine.quant.w8a8 import quantize_rows
from tests.conftest import ModelBundle


def gaussian(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def activations(rows: int, cols: int, *, seed: int) -> torch.Tensor:
    """bf16 rows with a few outlier channels, as a transformer's are: the per-row scale must cope."""
    x = gaussian(rows, cols, seed=seed)
    x[:, :: cols // 4] *= 20
    return x.bfloat16()


# oneDNN's int8 GEMM is exact only with an int8 dot instruction (VNNI, AMX-INT8); on plain AVX2 it
# saturates, and the kernel plan turns W8A8 off (tests/engine/quant/test_kernel_plan.py checks that).
needs_exact_int8_gemm = pytest.mark.skipif(not int8_gemm_is_exact(), reason="torch._int_mm saturates on this "
                                           "CPU's int8 path (no VNNI): W8A8 is off here")


@needs_exact_int8_gemm
def test_w8a8_matches_a_float64_reference() -> None:
    codes, scales = quantize_int8(gaussian(96, 256, seed=0))
    x = activations(16, 256, seed=1)
    got = w8a8_mm(x, codes, scales).double()
    assert got.shape == (16, 96)
    weight = codes.double() * scales.double()[:, None]  # (N, K): the same int8 weights, exactly
    # 1. The same computation in float64, the activations' per-row int8 rounding included: equal up to
    #    the bf16 output's rounding (2^-8 relative) and float32 scale arithmetic. A scale off by even 1%
    #    fails here.
    row_scale = x.double().abs().amax(1, keepdim=True) / 127
    want = ((x.double() / row_scale).round() * row_scale) @ weight.t()
    assert bool(((got - want).abs() <= want.abs() * 2.0**-8 + 1e-4 * float(want.abs().max())).all()), \
        float(((got - want).abs() / want.abs()).max())
    # 2. Against the exact product of the unrounded activations: within the worst case of that rounding,
    #    half a step (row_scale / 2) per activation, summed over a weight row, plus the bf16 output.
    exact = x.double() @ weight.t()
    bound = row_scale / 2 * weight.abs().sum(1)[None, :] + exact.abs() * 2.0**-8 + 1e-6
    assert bool(((got - exact).abs() <= bound).all())


@needs_exact_int8_gemm
def test_w8a8_is_the_exact_int32_product_rescaled() -> None:
    codes, scales = quantize_int8(gaussian(40, 128, seed=2))
    x = activations(9, 128, seed=3)
    xq, row_scale = quantize_rows(x)
    assert xq.dtype == torch.int8 and int(xq.abs().max()) == 127 and row_scale.shape == (9, 1)
    exact = xq.double() @ codes.double().t()  # integers, exact in float64
    want = (exact.float() * row_scale * scales).bfloat16()
    torch.testing.assert_close(w8a8_mm(x, codes, scales), want, rtol=0, atol=0)


@needs_exact_int8_gemm
def test_w8a8_rows_do_not_depend_on_the_batch() -> None:
    """int32 sums are exact, so a row's output is the same alone and among 31 others."""
    codes, scales = quantize_int8(gaussian(64, 192, seed=4))
    x = activations(32, 192, seed=5)
    batch = w8a8_mm(x, codes, scales)
    for i in (0, 17, 31):
        torch.testing.assert_close(w8a8_mm(x[i : i + 1], codes, scales)[0], batch[i], rtol=0, atol=0)


def test_int8_linear_runs_w8a8_on_its_own_codes_from_the_threshold() -> None:
    linear = Int8Linear(gaussian(80, 64, seed=6), w8a8=True)
    assert linear.w8a8_scales is not None
    many, few = activations(W8A8_ROWS, 64, seed=7), activations(W8A8_ROWS - 1, 64, seed=8)
    torch.testing.assert_close(linear(many), w8a8_mm(many, linear.weight_int8, linear.scales.float()), rtol=0, atol=0)
    weight_only = torch.ops.aten._weight_int8pack_mm(few, linear.weight_int8, linear.scales)
    torch.testing.assert_close(linear(few), weight_only, rtol=0, atol=0)
    assert Int8Linear(gaussian(80, 64, seed=6)).w8a8_scales is None  # off unless asked for


def test_int4_linear_keeps_an_int8_copy_of_its_4bit_values() -> None:
    q = quantize_int4(gaussian(96, 128, seed=9))
    linear = Int4Linear(q, w8a8=True)
    codes, scales = linear.w8a8_codes, linear.w8a8_scales
    assert codes is not None and scales is not None
    assert codes.dtype == torch.int8 and codes.shape == (96, 128) and scales.dtype == torch.float32
    # The copy is the 4-bit weight's values on a per-channel int8 grid: within half a step of them.
    assert bool(((codes.float() * scales[:, None] - q.dequantize()).abs() <= scales[:, None] / 2 + 1e-6).all())
    for rows in (W8A8_ROWS, 256):  # decode batches and prompt chunks alike
        x = activations(rows, 128, seed=rows)
        torch.testing.assert_close(linear(x), w8a8_mm(x, codes, scales), rtol=0, atol=0)
    x = activations(W8A8_ROWS - 1, 128, seed=10)
    plain = Int4Linear(q)
    assert plain.w8a8_codes is None and plain.w8a8_scales is None
    torch.testing.assert_close(linear(x), plain(x), rtol=0, atol=0)  # below the threshold: the 4-bit kernel


def test_w8a8_config_and_flag() -> None:
    with pytest.raises(ConfigError, match="w8a8 must be true or false"):
        EngineConfig(w8a8="yes")  # type: ignore[arg-type]
    parser = build_parser()
    assert engine_kwargs(parser.parse_args(["engine", "--no-w8a8"]))["w8a8"] is False
    assert engine_kwargs(parser.parse_args(["engine", "--w8a8"]))["w8a8"] is True
    assert engine_kwargs(parser.parse_args(["engine"]))["w8a8"] is EngineConfig().w8a8


# -- the bundled model ------------------------------------------------------------------------------

STREAMS = 8  # every decode step of all of them (8 rows) runs W8A8
TOKENS = 32
QUESTIONS = ["Tell me about the moon.", "Write a short poem about autumn leaves.",
             "What is the difference between a list and a tuple in Python?", "Give me three tips for a job interview.",
             "Why is the sky blue?", "How do I boil an egg?", "What is photosynthesis?", "Name three rivers in Europe."]
# Measured (int4, 8 streams x 32 greedy tokens) with torch's 4-bit kernel alone: position-wise agreement
# 0.16-0.91 per stream, mean 0.42; first divergence at tokens 14, 1, 23, 11, 10, 14, 5, 0, where the
# model's top-2 logits were 0.125-1.0 apart (bf16 logits move in steps of 0.125 here). Without W8A8 the
# same comparison diverged too, in 4 of 8 streams (tokens 8-22, at margins 0-0.125): batching is not
# bit-exact elsewhere either (attention, the prefill's kernels). With the int8-dot kernel alone (int8
# activations on the 4-bit codes, where W8A8 has them on an int8 copy: two different roundings):
# 0.06-0.78, mean 0.26, first divergence at 10, 1, 22, 4, 4, 6, 9, 2. W8A8 with its scales flipped
# (the wrong channels'): mean 0.016, zero in 6 of 8 streams. The floor sits between.
AGREEMENT_FLOOR = 0.15


@pytest.fixture(scope="module")
def int4_w8a8(bundled_gguf_path: Path) -> ModelBundle:
    native = load_model(bundled_gguf_path, dtype=torch.float32, native_int4=True)
    model = build_model(native.config, native.weights, EngineConfig(quantization="int4", w8a8=True), int4=native.int4)
    return ModelBundle(model, native.tokenizer)


@pytest.mark.model
def test_batched_w8a8_greedy_stays_close_to_each_stream_alone(int4_w8a8: ModelBundle) -> None:
    """Batch-dependent numerics, on purpose: decoding alone, a stream's steps are one row (the 4-bit
    kernel); among STREAMS they are W8A8 (int8 activations, an int8 copy of the 4-bit weights). Both
    are close to the file's weights (teacher-forced agreement with fp32: tests/engine/test_quantized.py)
    but not bit-equal, so a near-tie can go the other way, and greedy text diverges from there on, as
    it does in vLLM between batch sizes. Free-running agreement is therefore far below teacher-forced."""
    assert STREAMS >= W8A8_ROWS
    tok = int4_w8a8.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS[:STREAMS]]
    greedy = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    engine: Engine = int4_w8a8.engine(kv_cache_gib=0.05, max_model_len=512, enable_prefix_caching=False)
    together = engine.generate(prompts, greedy)
    alone = [engine.generate([p], greedy)[0] for p in prompts]
    pairs = [(x.token_ids, y.token_ids) for x, y in zip(together, alone, strict=True)]
    per_stream = [sum(a == b for a, b in zip(x, y, strict=True)) / TOKENS for x, y in pairs]
    first = [next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), TOKENS) for x, y in pairs]
    mean = sum(per_stream) / len(per_stream)
    print(f"W8A8 batch of {STREAMS} vs alone, {TOKENS} greedy tokens: position-wise agreement "
          f"{[round(a, 3) for a in per_stream]}, mean {mean:.3f}; first divergence at {first}")
    assert mean >= AGREEMENT_FLOOR, per_stream
