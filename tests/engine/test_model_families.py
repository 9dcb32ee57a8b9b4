"""The model families the builtin engine runs (engine/loader/architectures.py), each against transformers.

For Llama 3.x (rope_type llama3), Mistral, Qwen2 (q/k/v biases) and Qwen3 (q/k norms): a tiny random
model built here with transformers and saved with `save_pretrained`; the engine loads the directory and
must give transformers' fp32 logits (within 1e-4) and its greedy tokens over 32 steps, with n-gram
speculation off and on. The same weights written as GGUF with the gguf library must load to the same
logits. Weights are random at a scale where greedy choices are decided by clear margins, and norms and
biases are random too, so a norm or bias that is dropped or misplaced changes the logits.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from decodeservice.engine import Engine, EngineConfig, SamplingParams, SpeculativeConfig
from decodeservice.engine.engine import build_model
from decodeservice.engine.errors import UnsupportedModelError
from decodeservice.engine.loader import LoadedModel, load_model
from decodeservice.engine.model import LlamaModel
from decodeservice.engine.quant import Int4Linear, Int8Linear, quantize_int4, quantize_int8
from tests.engine.test_loader import (
    MERGES,
    SPECIALS,
    TEMPLATE,
    TOKENS,
    llama_cpp_permute,
    save_tiny_tokenizer,
)

Q = gguf.GGMLQuantizationType
LAYERS, HIDDEN, FFN, HEADS, KV_HEADS = 2, 64, 128, 4, 2
CONTEXT = 256
PROMPT = [40, 41, 42, 43, 44] * 3 + [100, 7, 200, 40, 41]  # periodic: n-gram lookup proposes drafts
STEPS = 32


@dataclass(frozen=True, kw_only=True)
class Family:
    name: str
    gguf_arch: str  # what llama.cpp converts it to
    config: dict[str, Any]  # transformers config kwargs beyond the shared sizes


FAMILIES = [
    # Llama 3.1/3.2: scaled RoPE; with head_dim 16, theta 5e5 and an original context of 64, the 8
    # frequencies fall in all three regimes (kept, blended, divided by the factor). Tied, as 3.2 1B/3B are.
    Family(name="llama3", gguf_arch="llama", config=dict(
        model_type="llama", tie_word_embeddings=True, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    # Mistral: head_dim given (wider than hidden / heads, as Mistral-Nemo's), and a sliding window.
    Family(name="mistral", gguf_arch="llama", config=dict(
        model_type="mistral", head_dim=32, sliding_window=CONTEXT, rope_theta=1e6)),
    Family(name="qwen2", gguf_arch="qwen2", config=dict(model_type="qwen2", tie_word_embeddings=True, rope_theta=1e6)),
    Family(name="qwen3", gguf_arch="qwen3", config=dict(model_type="qwen3", head_dim=32, rope_theta=1e6)),
]
BY_NAME = {f.name: f for f in FAMILIES}


def hf_model(family: Family) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = dict(family.config)
    config = AutoConfig.for_model(
        kwargs.pop("model_type"), vocab_size=len(TOKENS), hidden_size=HIDDEN, intermediate_size=FFN,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        max_position_embeddings=CONTEXT, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, **kwargs)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.normal_(0.0, 0.5)
            else:
                param.normal_(0.0, 0.3)  # peaky logits: greedy comparisons are not decided by ties
    return model.eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """Each family's transformers model and the HF directory it saved."""
    out = {}
    for family in FAMILIES:
        path = tmp_path_factory.mktemp(family.name)
        model = hf_model(family)
        model.save_pretrained(path)
        save_tiny_tokenizer(path)
        out[family.name] = (path, model)
    return out


def head_dim(config: Any) -> int:
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def hf_logits(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits: torch.Tensor = model(torch.tensor([ids])).logits[0].float()
    return logits  # (T, V)


def hf_greedy_choices(model: Any, prompt: list[int], tokens: list[int]) -> list[int]:
    """What transformers' greedy decoding picks after the prompt and each prefix of `tokens`: one causal
    forward over prompt + tokens gives every step's logits, so `tokens` is transformers' own greedy
    continuation exactly when this returns it."""
    logits = hf_logits(model, prompt + tokens)  # (P + S, V); row P - 1 + i predicts tokens[i]
    return [int(t) for t in logits[len(prompt) - 1:-1].argmax(-1)]


def our_model(loaded: LoadedModel, **config: Any) -> LlamaModel:
    return build_model(loaded.config, loaded.weights, EngineConfig(**config), int4=loaded.int4)


def greedy(model: LlamaModel, loaded: LoadedModel, *, speculative: bool) -> tuple[list[int], int]:
    """Our engine's greedy tokens, and how many draft tokens it verified."""
    spec = SpeculativeConfig(method="ngram", num_tokens=4, draft_row_cost=0.0) if speculative else None
    engine = Engine(model=model, tokenizer=loaded.tokenizer, config=EngineConfig(
        num_gpu_blocks_override=64, max_num_batched_tokens=64, speculative=spec))
    out = engine.generate([PROMPT], SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True))[0]
    return list(out.token_ids), engine.stats().spec_decode.num_draft_tokens


@pytest.mark.parametrize("name", list(BY_NAME))
def test_hf_dir_matches_transformers(saved: dict[str, tuple[Path, Any]], name: str) -> None:
    path, theirs = saved[name]
    loaded = load_model(path)
    c = loaded.config
    assert (c.qkv_bias, c.qk_norm) == (name == "qwen2", name == "qwen3")
    assert (c.rope_freq_factors is not None) is (name == "llama3")
    assert c.head_dim == head_dim(theirs.config) and c.tie_word_embeddings is theirs.config.tie_word_embeddings
    assert (c.sliding_window, c.max_position_embeddings) == ((CONTEXT, CONTEXT) if name == "mistral" else (None, CONTEXT))
    assert loaded.tokenizer.chat_template == TEMPLATE and loaded.tokenizer.eos_token_ids == (2, 0)

    ours = our_model(loaded)
    ids = PROMPT + list(range(50, 90))  # positions up to 60: every frequency of the llama3 RoPE turns
    want = hf_logits(theirs, ids)
    torch.testing.assert_close(ours.forward_dense(torch.tensor(ids)), want, rtol=0, atol=1e-4)

    plain, _ = greedy(ours, loaded, speculative=False)
    speculated, drafted = greedy(ours, loaded, speculative=True)
    assert len(plain) == STEPS and plain == hf_greedy_choices(theirs, PROMPT, plain)
    assert speculated == plain
    assert drafted > 0  # speculation really ran: drafts were scored in multi-row verifies


def write_gguf(path: Path, family: Family, hf: Any, *, qtype: Any = Q.F32,
               edit: Callable[[gguf.GGUFWriter], None] | None = None) -> Path:
    """The transformers model's weights as llama.cpp's converter lays them out for `family.gguf_arch`.

    Projections are written as `qtype`; norms, biases and rope_freqs F32, as llama.cpp keeps 1-D tensors.
    `edit` adds to the file before it is written."""
    cfg, arch = hf.config, family.gguf_arch
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(head_dim(cfg))
    writer.add_value_length(head_dim(cfg))
    writer.add_rope_dimension_count(head_dim(cfg))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm" if arch == "llama" else "qwen2")
    writer.add_token_list(TOKENS)
    writer.add_token_merges(MERGES)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(TOKENS) - len(SPECIALS)))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(TEMPLATE)
    if rope["rope_type"] == "llama3":  # convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors
        writer.add_tensor("rope_freqs.weight", llama3_rope_freqs(rope, head_dim(cfg)))

    layer_names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                   "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
                   "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm",
                   "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    global_names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                    "lm_head.weight": "output.weight"}
    for name, tensor in hf.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        w = tensor.numpy().astype(np.float32)
        if name in global_names:
            gguf_name = global_names[name]
        else:
            _, _, layer, rest = name.split(".", 3)
            module, _, kind = rest.rpartition(".")
            gguf_name = f"blk.{layer}.{layer_names[module]}.{kind}"
            if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
                w = llama_cpp_permute(w, HEADS if module.endswith("q_proj") else KV_HEADS)
        if w.ndim == 1 or qtype == Q.F32:
            writer.add_tensor(gguf_name, w)
        else:
            writer.add_tensor(gguf_name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    if edit is not None:
        edit(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def llama3_rope_freqs(rope: dict[str, Any], head_dim: int) -> np.ndarray:
    """llama.cpp's rope_freqs for rope_type llama3, written here as its converter computes it."""
    base, factor = rope["rope_theta"], rope["factor"]
    low, high, original = rope["low_freq_factor"], rope["high_freq_factor"], rope["original_max_position_embeddings"]
    factors = []
    for freq in 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            factors.append(1.0)
        elif wavelen > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


@pytest.mark.parametrize("name", list(BY_NAME))
def test_gguf_matches_transformers(saved: dict[str, tuple[Path, Any]], name: str, tmp_path: Path) -> None:
    _, theirs = saved[name]
    family = BY_NAME[name]
    loaded = load_model(write_gguf(tmp_path / f"{name}.gguf", family, theirs))
    assert (loaded.config.qkv_bias, loaded.config.qk_norm) == (name == "qwen2", name == "qwen3")
    ids = PROMPT + list(range(50, 90))
    torch.testing.assert_close(our_model(loaded).forward_dense(torch.tensor(ids)), hf_logits(theirs, ids),
                               rtol=0, atol=1e-4)


def dequantized(weights: dict[str, torch.Tensor], weight_format: str) -> dict[str, torch.Tensor]:
    """The matrices as the quantized engine holds them (int8 per row, int4 in groups of 32 along each row,
    as engine/quant quantizes them: row-local, so fusing q/k/v first changes nothing), back in fp32."""
    def roundtrip(w: torch.Tensor) -> torch.Tensor:
        if weight_format == "int4":
            return quantize_int4(w, group_size=32).dequantize()
        codes, scales = quantize_int8(w)
        return codes.float() * scales.unsqueeze(1)

    return {name: roundtrip(w) if w.ndim == 2 else w for name, w in weights.items()}


@pytest.mark.parametrize("weight_format", ["int8", "int4"])
def test_quantized_paths_keep_biases_and_norms(saved: dict[str, tuple[Path, Any]], weight_format: str) -> None:
    """Quantized, each family computes what fp32 computes from the same quantized weights, up to bf16
    activations: biases and q/k norms stay dense and in place (dropping one moves logits by 1-3 on average
    here, 5-12 at most)."""
    ids = torch.tensor(PROMPT + list(range(50, 90)))
    for name in ("qwen2", "qwen3"):  # what the quantized path adds for them; Llama's own is test_quantized.py's
        loaded = load_model(saved[name][0])
        model = our_model(loaded, quantization=weight_format)
        attn = model.decoder_layers()[0].self_attn
        assert model.weight_format == weight_format
        assert isinstance(attn.qkv_proj, Int8Linear if weight_format == "int8" else Int4Linear)
        for dense in (attn.qkv_bias, attn.qk_norm.weight if attn.qk_norm is not None else None):
            assert dense is None or (isinstance(dense, torch.nn.Parameter) and dense.dtype == model.activation_dtype)
        assert (attn.qkv_bias is not None, attn.qk_norm is not None) == (name == "qwen2", name == "qwen3")
        reference = build_model(loaded.config, dequantized(loaded.weights, weight_format), EngineConfig())
        want, got = reference.forward_dense(ids), model.forward_dense(ids)
        # bf16 activations (where this CPU runs them faster) move single logits by up to ~0.7, 0.02-0.06 on average
        assert float((got - want).abs().mean()) < 0.15, name
        assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) >= 0.9, name


def test_gguf_rope_it_cannot_run_is_refused(saved: dict[str, tuple[Path, Any]], tmp_path: Path) -> None:
    hf = saved["mistral"][1]
    linear = write_gguf(tmp_path / "linear.gguf", BY_NAME["mistral"], hf,
                        edit=lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR))
    with pytest.raises(UnsupportedModelError, match="RoPE scaling 'linear'"):
        load_model(linear)
    short = write_gguf(tmp_path / "short.gguf", BY_NAME["mistral"], hf,
                       edit=lambda w: w.add_tensor("rope_freqs.weight", np.ones(3, dtype=np.float32)))
    with pytest.raises(UnsupportedModelError, match="rope_freq_factors needs head_dim // 2 = 16"):
        load_model(short)


@pytest.mark.parametrize("name", list(BY_NAME))
def test_gguf_q4_loads_as_native_int4(saved: dict[str, tuple[Path, Any]], name: str, tmp_path: Path) -> None:
    """A Q4_0 GGUF runs int4 from its own codes (never dequantized); biases, norms and rope_freqs stay F32."""
    path = write_gguf(tmp_path / f"{name}.gguf", BY_NAME[name], saved[name][1], qtype=Q.Q4_0)
    native = load_model(path, native_int4=True)
    assert native.int4 and all(w.ndim == 1 for w in native.weights.values())  # only 1-D tensors dense
    model = our_model(native)  # quantization auto: the source's own 4-bit
    assert model.weight_format == "int4"
    ids = torch.tensor(PROMPT + list(range(50, 90)))
    want = our_model(load_model(path)).forward_dense(ids)  # the same codes, dequantized, fp32
    got = model.forward_dense(ids)
    assert float((got - want).abs().mean()) < 0.15
    assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) >= 0.9
