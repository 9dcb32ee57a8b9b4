"""engine/quant: int4 and int8 weights on torch's CPU kernels, checked against dense references.

Tiny random weights check the kernels' conventions and the GGUF 4-bit path bit for bit; the bundled
model checks that quantized greedy decoding stays close to fp32 and that speculation stays lossless."""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import pytest
import torch

from decodeservice.engine import Engine, EngineConfig, SamplingParams, SpeculativeConfig
from decodeservice.engine.engine import build_model
from decodeservice.engine.errors import ConfigError
from decodeservice.engine.loader import LoadedModel, load_model
from decodeservice.engine.quant import (
    Int4Embedding,
    Int4Linear,
    Int8Embedding,
    Int8Linear,
    quantize_int4,
    quantize_int8,
)
from decodeservice.engine.quant.cpu import detect_cpu
from decodeservice.engine.quant.int4 import QUANTIZE_ROWS, pack_nibbles, unpack_nibbles
from decodeservice.engine.quant.step_rows import StepRows
from tests.conftest import ModelBundle
from tests.engine.test_loader import write_tiny_gguf

Q = gguf.GGMLQuantizationType
PROMPTS = [
    "Tell me about the moon.",
    "Write a short poem about autumn leaves.",
    "What is the difference between a list and a tuple in Python?",
    "Give me three tips for a job interview.",
]


def weight(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


# -- kernels and formats on tiny random weights ----------------------------------------------------


def test_tall_matrices_quantize_in_chunks_like_whole() -> None:
    """quantize_int4 works QUANTIZE_ROWS rows at a time (peak memory); the result is the whole matrix's."""
    weight = torch.randn(QUANTIZE_ROWS + 37, 64, generator=torch.Generator().manual_seed(0))
    int4 = quantize_int4(weight)
    assert int4.shape == (QUANTIZE_ROWS + 37, 64) and int4.scale.shape == (QUANTIZE_ROWS + 37, 2)
    # Every group within half a step of its values, the last chunk's rows included.
    err = (int4.dequantize() - weight).abs().view(-1, 2, 32).amax(-1)
    assert bool((err <= int4.scale / 2 + 1e-6).all())


def test_nibbles_round_trip() -> None:
    codes = torch.randint(0, 16, (5, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    assert torch.equal(unpack_nibbles(pack_nibbles(codes)), codes)


@pytest.mark.parametrize("group_size", [32, 64])
def test_int4_linear_matches_its_dequantized_weight(group_size: int) -> None:
    w = weight(96, 128)
    q = quantize_int4(w, group_size=group_size)
    # Quantization itself: every weight within half a step of its group.
    step = q.scale.repeat_interleave(group_size, dim=1)
    assert bool(((q.dequantize() - w).abs() <= step / 2 + 1e-6).all())
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(2)).bfloat16()
    got = Int4Linear(q)(x)
    assert got.shape == (5, 96) and got.dtype == torch.bfloat16
    # The kernel reads bf16 scales and zeros: the reference uses the same rounded values, so what is
    # left is bf16 accumulation/rounding of the output (a wrong zero convention is off by ~8 scales).
    scale = q.scale.bfloat16().float()
    zero = (q.offset + 8 * q.scale).bfloat16().float()
    codes = q.codes().float().view(96, -1, group_size)
    dense = ((codes - 8) * scale.unsqueeze(-1) + zero.unsqueeze(-1)).view(96, 128)
    want = x.float() @ dense.t()
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))
    # One row and several rows through the same kernel give the same row (speculation relies on it).
    linear = Int4Linear(q)
    torch.testing.assert_close(linear(x[:1]), got[:1], rtol=0, atol=0)
    # The reference dequantizes our own codes, never the kernel's ISA-specific layout.
    torch.testing.assert_close(linear.dense_weight(torch.float32), dense, rtol=1e-2, atol=1e-2)
    rows = torch.randn(256, 128, generator=torch.Generator().manual_seed(3)).bfloat16()
    want_rows = rows.float() @ dense.t()
    torch.testing.assert_close(linear(rows).float(), want_rows, rtol=2e-2, atol=2e-2 * float(want_rows.abs().max()))
    # fp32 activations (CPUs without native bf16): the kernel still gets bf16 rows, the caller fp32 back.
    got32 = linear(x.float())
    assert got32.dtype == torch.float32
    torch.testing.assert_close(got32, got.float(), rtol=0, atol=0)


def test_int8_linear_matches_reference() -> None:
    w = weight(80, 64, seed=3)
    codes, scales = quantize_int8(w)
    assert codes.dtype == torch.int8 and int(codes.abs().max()) == 127
    assert bool(((codes.float() * scales[:, None] - w).abs() <= scales[:, None] / 2 + 1e-6).all())
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(4)).bfloat16()
    got = Int8Linear(w)(x)
    want = x.float() @ (codes.float() * scales.bfloat16().float()[:, None]).t()
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))


def test_quantized_embeddings_dequantize_the_looked_up_rows() -> None:
    w = weight(50, 64, seed=5)
    ids = torch.tensor([3, 0, 49, 3])
    q = quantize_int4(w)
    assert torch.equal(Int4Embedding(q, dtype=torch.float32)(ids), q.dequantize()[ids])
    head = Int8Linear(w, dtype=torch.float32)
    embed = Int8Embedding(head.weight_int8, head.scales, dtype=torch.float32)
    assert embed.codes is head.weight_int8  # a tied head shares its codes with the embedding
    torch.testing.assert_close(embed(ids), head.weight_int8[ids].float() * head.scales[ids, None])


@pytest.mark.parametrize("tied", [False, True])
def test_gguf_q4_tensors_load_as_int4_exactly(tmp_path: Path, tied: bool) -> None:
    """Q4_0/Q4_1 -> Int4Weight without fp32, equal bit for bit to the gguf library's dequantization
    (q/k included: their rows are un-permuted for rotate-half RoPE as codes and scales)."""
    qtypes = {"attn_q": Q.Q4_1, "attn_k": Q.Q4_0, "attn_v": Q.Q4_0, "ffn_gate": Q.Q4_1, "token_embd": Q.Q4_1}
    path, _, used = write_tiny_gguf(tmp_path / "q4.gguf", tied=tied, qtypes=qtypes)
    dense = load_model(path)
    native = load_model(path, native_int4=True)
    four_bit = {name for name, qtype in used.items() if qtype in (Q.Q4_0, Q.Q4_1)}
    assert set(native.int4) == four_bit and not four_bit & set(native.weights)
    for name in four_bit:
        assert torch.equal(native.int4[name].dequantize(), dense.weights[name]), name
    for name in set(dense.weights) - four_bit:
        assert torch.equal(native.weights[name], dense.weights[name]), name


# -- the quantized model on tiny random weights ------------------------------------------------------


def tiny_pair(tmp_path: Path, fmt: str) -> tuple[Engine, Engine]:
    """The same tiny GGUF as a dense fp32 engine and as a `fmt` engine. Every matrix is 4-bit in the
    file, so the int4 engine runs exactly the file's weights and differs from fp32 only by its bf16
    activations (a 4-bit requantization of random Gaussian weights would swamp that). W8A8 is off: the
    paged decode (1-row steps) must equal the reference forward (a prompt's rows at once) exactly, and
    with it on, the two take different kernels from W8A8_ROWS rows (tests/engine/quant/test_w8a8.py)."""
    qtypes = {"attn_q": Q.Q4_1, "attn_k": Q.Q4_1, "attn_v": Q.Q4_0, "ffn_gate": Q.Q4_1, "ffn_up": Q.Q4_1,
              "token_embd": Q.Q4_1}
    path, _, _ = write_tiny_gguf(tmp_path / "t.gguf", tied=True, qtypes=qtypes)
    dense = Engine.from_pretrained(str(path), quantization="none", kv_cache_gib=0.01)
    quant = Engine.from_pretrained(str(path), quantization=fmt, kv_cache_gib=0.01, w8a8=False)
    return dense, quant


@pytest.mark.parametrize("fmt", ["int4", "int8", "auto"])
def test_tiny_quantized_model(tmp_path: Path, fmt: str) -> None:
    dense, quant = tiny_pair(tmp_path, fmt)
    want = "int4" if fmt == "auto" else fmt
    # bf16 activations where this CPU has native bf16, fp32 where not (engine/quant/kernel_plan.py).
    assert quant.model.weight_format == want
    assert quant.dtype == (torch.bfloat16 if detect_cpu().native_bf16 else torch.float32)
    assert dense.model.weight_format == "none" and dense.dtype == torch.float32
    heads = [m for m in quant.model.modules() if isinstance(m, Int4Linear | Int8Linear)]
    assert len(heads) == 2 * 2 + 2 * 2 + 1  # qkv, o, gate_up, down per layer, and the head
    ids = torch.tensor(quant.tokenizer.encode(" the hell tell the"))
    # Close to the dense model of the same file: logits within a fraction of their spread.
    ref, got = dense.model.forward_dense(ids), quant.model.forward_dense(ids)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    err = float((got - ref).pow(2).mean().sqrt())
    assert err < 0.1 * float(ref.std()), err
    # The paged decode path (prefill, then one token a step) equals the reference forward of the
    # quantized model itself, greedy token for token, where the reference computes each row's
    # projections by the engine's function for that row: the prompt's rows as prompt rows (one path
    # whatever their count, StepRows), the decoded tokens' rows as decode rows.
    out = quant.generate([ids.tolist()], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    seq = ids.tolist()
    for _ in range(12):
        rows = StepRows(prompt_rows=torch.arange(len(ids)),
                        other_rows=torch.arange(len(ids), len(seq)) if len(seq) > len(ids) else None)
        seq.append(int(quant.model.forward_dense(torch.tensor(seq), rows=rows)[-1].argmax()))
    assert out.token_ids == seq[len(ids):]


# -- start-up errors -------------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"quantization": "int3"}, "quantization must be none, int8, int4 or auto"),
    ({"quantization": "int4", "device": "cuda"}, "runs on CPU only"),
    ({"quantization": "int8", "device": "cuda:0"}, "runs on CPU only"),
    ({"quantization": "int4", "dtype": "float16"}, "runs bfloat16 or float32 activations"),
    ({"quantization": "int8", "dtype": "float16"}, "runs bfloat16 or float32 activations"),
    ({"dtype": "float64"}, "dtype must be"),
])
def test_unsupported_precision_is_a_config_error(kwargs: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        EngineConfig(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=message):  # at start-up, before any model is read
        Engine.from_pretrained("no-such-model", **kwargs)


def test_auto_runs_what_the_source_holds(tiny: ModelBundle) -> None:
    # A dense source under auto stays dense (fp32 on CPU), so fp32 references stay fp32.
    assert tiny.engine().dtype == torch.float32
    assert EngineConfig().quantization == "auto" and EngineConfig().dtype == "auto"


# -- the bundled model: close to fp32, and speculation stays lossless --------------------------------

# Fixed answers to teacher-force: every position's greedy choice is compared under the same context,
# so one early difference does not decide the other 63 positions.
ANSWERS = [
    "The Moon is Earth's only natural satellite. It orbits our planet at an average distance of about "
    "384,400 kilometres and takes roughly 27 days to complete one orbit. Its surface is covered in craters, "
    "mountains and wide dark plains called maria, formed by ancient volcanic eruptions. The Moon "
    "has no atmosphere to speak of, so its temperature swings from very hot by day to very cold by night.",
    "Golden leaves drift down in the cool autumn air,\nThey dance on the wind without worry or care.\n"
    "Red, orange and amber, they carpet the ground,\nAnd crunch under footsteps with a soft, gentle sound.\n"
    "The branches stand bare as the evenings grow long,\nWhile geese overhead sing their last autumn song.\n"
    "The pumpkins are glowing on porches and sills,\nAnd mist settles softly on valleys and hills.\n"
    "So gather your scarf and walk out in the light,\nBefore the cold winter arrives overnight.",
    "A list is mutable, which means you can add, remove or change its elements after it is created. A tuple "
    "is immutable: once it is created, its contents cannot change. Lists use square brackets and tuples use "
    "parentheses. Tuples can be used as dictionary keys because they are hashable. "
    "In general, use a list for a collection that changes and a tuple for a fixed group of values.",
    "1. Research the company before the interview so you understand its products, culture and goals.\n"
    "2. Practice answers to common questions, and prepare examples that show your skills.\n"
    "3. Arrive on time, dress appropriately, and ask thoughtful questions at the end. "
    "Follow up with a short thank-you email within a day to show your interest in the role.",
]
POSITIONS = 64


@pytest.fixture(scope="module")
def quantized(bundled_gguf_path: Path, bundled: ModelBundle) -> dict[str, ModelBundle]:
    """int4 straight from the file's Q4_1 codes, and int8 from the same file; one load for all. Keys
    "int4", "int8": the weight-only kernels alone (w8a8 off); "int4+w8a8", "int8+w8a8": with the opt-in `w8a8`,
    calls of W8A8_ROWS rows or more (every teacher-forced prompt here) run int8 x int8."""
    native: LoadedModel = load_model(bundled_gguf_path, dtype=torch.float32, native_int4=True)
    return {f"{fmt}{'+w8a8' if w8a8 else ''}": ModelBundle(
        build_model(native.config, native.weights, EngineConfig(quantization=fmt, w8a8=w8a8), int4=native.int4),
        bundled.tokenizer) for fmt in ("int4", "int8") for w8a8 in (False, True)}


def teacher_forced_agreement(reference: ModelBundle, other: ModelBundle) -> list[float]:
    tok = reference.tokenizer
    agreement = []
    for prompt, answer in zip(PROMPTS, ANSWERS, strict=True):
        head = tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}]))
        ids = torch.tensor(head + tok.encode(answer)[:POSITIONS])
        assert len(ids) == len(head) + POSITIONS
        # Logits at the last prompt token and the first 63 answer tokens: 64 next-token choices.
        want = reference.model.forward_dense(ids)[len(head) - 1 : -1].argmax(-1)
        got = other.model.forward_dense(ids)[len(head) - 1 : -1].argmax(-1)
        agreement.append(float((want == got).float().mean()))
    return agreement


@pytest.mark.model
@pytest.mark.parametrize(("fmt", "floor"), [
    ("int8", 0.9),  # the agreement bar int8 weights must keep
    # 4-bit weights (the file's own, plus the Q8_0 embedding/head requantized to 4-bit): measured 0.83
    # to 0.91 per prompt, 0.87 mean (int8: 0.92 to 0.98); the floor sits below that.
    ("int4", 0.8),
    # W8A8 (what calls of W8A8_ROWS rows or more run) adds int8 activations, one scale per row, and for
    # int4 an int8 re-quantization of the 4-bit values. Measured: int8+w8a8 0.88-0.94 per prompt, mean 0.898 (below
    # the 0.9 bar for int8 weights, which the weight-only kernel meets); int4+w8a8 0.78-0.89,
    # mean 0.848 (int4 alone 0.871). Floors below those.
    ("int8+w8a8", 0.85),
    ("int4+w8a8", 0.8),
])
def test_quantized_greedy_agrees_with_fp32(bundled: ModelBundle, quantized: dict[str, ModelBundle], fmt: str,
                                           floor: float) -> None:
    """fp32 is the same GGUF dequantized, so int4 differs from it only where the weights do not."""
    agreement = teacher_forced_agreement(bundled, quantized[fmt])
    print(f"{fmt} teacher-forced greedy agreement with fp32 over {POSITIONS} tokens: {agreement}")
    assert sum(agreement) / len(agreement) >= floor, agreement


def continuation_nll(reference: ModelBundle, prompt: list[int], continuation: list[int]) -> float:
    """Mean negative log-likelihood per token of `continuation` after `prompt` under `reference`."""
    ids = torch.tensor(prompt + continuation)
    logprobs = reference.model.forward_dense(ids)[len(prompt) - 1 : -1].float().log_softmax(-1)
    return -float(logprobs.gather(1, torch.tensor(continuation)[:, None]).mean())


# One coherent report, repeated to ~1k tokens: its summary is well defined. The first version of the test
# summarized ANSWERS * 3 (eight unrelated answers): there int4's first token differed from fp32's with
# every kernel, and the 24-token continuation's score then swung between 0.78 and 1.42 nat/token across
# kernel variants of the same per-projection accuracy (int8-dot or torch's kernel, on the projections
# or the head; measured under the AVX2 caps), a coin toss rather than a measure of the prompt path.
REPORT = (
    "The harbour authority published its yearly report on Monday. Cargo volumes rose by eight percent, "
    "mostly from container traffic, while bulk grain shipments fell after a dry summer inland. The new "
    "crane on the eastern quay cut the average unloading time from eleven hours to seven. Two ferry "
    "routes were added to the islands, and the old fish market will become a visitor centre next spring. "
    "The authority plans to dredge the main channel in autumn so that larger ships can dock at low tide. "
)


@pytest.mark.model
@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_text_after_a_long_prompt_scores_like_fp32s(bundled: ModelBundle, quantized: dict[str, ModelBundle],
                                                     fmt: str) -> None:
    """What broke on AVX2: prompt chunks of 256+ rows ran on weights read back from the kernel's
    AVX-512 layout, so after a long prompt the default engine wrote nonsense. A ~1k-token prompt runs
    in chunks of 512 rows (each projection on the path this machine's plan picks for them), then 24
    greedy tokens; the fp32 model scores both engines' continuations. Within 1 nat/token of fp32's own
    (the text-quality target); garbage weights score ~10."""
    tok = bundled.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": REPORT * 11 + "\nSummarize the report above."}]))
    assert 900 <= len(prompt) <= 1400, len(prompt)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    runs = {name: bundle.engine(kv_cache_gib=0.2, max_model_len=2048).generate([prompt], greedy)[0].token_ids
            for name, bundle in (("fp32", bundled), (fmt, quantized[fmt]))}
    nll = {name: continuation_nll(bundled, prompt, ids) for name, ids in runs.items()}
    print(f"{fmt} after {len(prompt)} prompt tokens: nll/token {nll}; text {tok.decode(runs[fmt])!r}")
    assert nll[fmt] <= nll["fp32"] + 1.0, nll


# The projections are row-invariant (a row's result does not depend on the other rows, checked above),
# but CPU attention is not bit-for-bit: with 9 query rows instead of 1 a row can differ by one bf16 ulp
# (measured at 700 keys), and in bf16 that can flip a near-tie (int8 flipped one in one run of several).
# So the lossless claim at bf16 is: speculation never changes a token the target chose with a clear
# margin. Any divergence must sit at a near-tie of the target's own logits; a real verification bug
# (a wrong accepted draft) diverges at a decided token and fails here.
# A near-tie is counted in bf16 steps at the top logit's size, not in absolute logits: the spacing of
# bf16 values is 0.125 from 16 to 32 and 0.25 from 32 to 64, and this test once failed on a new machine
# at top-2 logits of 35.25 and 35.0, one bf16 step apart (its kernels round differently from the
# machine the old fixed 0.25 was tuned on).
# On a CPU run of the AVX2 dispatch (fp32 activations; the int4 kernel takes them as bf16) the noise is
# larger: swapping only plain decoding's attention kernel (the native one for the torch paths, both fp32
# and exact to ~1e-6) moved a top logprob by 0.26 (4.2 bf16 steps at a logit of 14), and one softmax
# summation order in that kernel flipped a 4.3-step margin. So a near-tie is 8 steps, twice that measured
# noise; of the 40 positions these prompts decode, 31 have a wider margin, and accepting every draft
# (greedy_accept mutated to keep them all) fails here under both dispatches, int4 at a 11-21-step margin.
# W8A8 is off here: with it, a verify step of the two prompts (2 x (1 + 5) rows) reaches W8A8_ROWS and
# runs int8 x int8, while plain decoding (2 rows) runs the weight-only kernel, so the two runs differ by
# W8A8's rounding, not by speculation (measured with it on: int8 diverged at a 0.31-logit margin).
# Speculation stays exact with respect to the kernels its verify runs; which kernels those are depends
# on the rows in the step, as for any batch (tests/engine/quant/test_w8a8.py).
NEAR_TIE_BF16_STEPS = 8


def bf16_step(x: float) -> float:
    """The gap between adjacent bf16 values at |x| (8 significant bits)."""
    return float(torch.finfo(torch.bfloat16).eps) * 2.0 ** math.floor(math.log2(abs(x)))


def test_bf16_step_is_the_spacing_of_bf16_values() -> None:
    for x in (1.0, 20.0, 35.25, -40.0, 100.0):
        above = torch.tensor(x, dtype=torch.bfloat16).abs()
        nxt = torch.nextafter(above, torch.tensor(float("inf"), dtype=torch.bfloat16))
        assert bf16_step(x) == float(nxt - above)


@pytest.mark.model
@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_quantized_speculation_changes_no_decided_token(quantized: dict[str, ModelBundle], fmt: str) -> None:
    bundle = quantized[fmt]
    tok = bundle.tokenizer
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": "Fix the spelling and return the whole text: Teh cat "
                                  "sat on teh mat and lookd at the moon. Then teh cat went to slep."}]),
        tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]),
    ]
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    plain = bundle.engine(kv_cache_gib=0.1, max_model_len=1024).generate(prompts, greedy)
    spec = SpeculativeConfig(method="ngram", num_tokens=5, draft_row_cost=0.0)  # always draft: verify every step
    engine = bundle.engine(kv_cache_gib=0.1, max_model_len=1024, speculative=spec)
    drafted = engine.generate(prompts, greedy)
    assert engine.stats().spec_decode.num_accepted_tokens > 0
    identical = 0
    for want, got in zip(plain, drafted, strict=True):
        if got.token_ids == want.token_ids:
            identical += 1
            continue
        at = next(i for i, (a, b) in enumerate(zip(want.token_ids, got.token_ids, strict=True)) if a != b)
        logits = bundle.model.forward_dense(torch.tensor(want.prompt_token_ids + want.token_ids[:at]))[-1]
        top2 = logits.float().topk(2).values
        margin, step = float(top2[0] - top2[1]), bf16_step(float(top2[0]))
        print(f"{fmt}: speculation diverged at token {at}, target's top-2 logits {top2.tolist()}, "
              f"margin {margin / step:.1f} bf16 steps")
        assert margin <= NEAR_TIE_BF16_STEPS * step, (
            f"{fmt}: diverged at a decided token {at} (top-2 {top2.tolist()}, margin {margin / step:.1f} bf16 steps)")
    print(f"{fmt}: {identical}/{len(prompts)} answers token-identical with speculation")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here: the GPU path (bf16 weights "
                    "and activations under dtype/quantization auto) runs only where one is")
def test_cuda_auto_runs_bf16(tmp_path: Path) -> None:
    path, _, _ = write_tiny_gguf(tmp_path / "t.gguf", tied=True, qtypes={"attn_q": Q.Q4_1})
    engine = Engine.from_pretrained(str(path), device="cuda", kv_cache_gib=0.01)
    assert engine.model.weight_format == "none" and engine.dtype == torch.bfloat16
    ids = engine.tokenizer.encode(" the hell tell the")
    out = engine.generate([ids], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    seq = list(ids)
    for _ in range(8):
        seq.append(int(engine.model.forward_dense(torch.tensor(seq, device="cuda"))[-1].argmax()))
    assert out.token_ids == seq[len(ids):]
