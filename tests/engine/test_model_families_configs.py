"""Which models load (engine/loader/architectures.py): the config.json of real checkpoints in each
family, what is refused and how the refusal reads, and the GGUF pre-tokenizers Qwen and Mistral-Nemo use."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import pytest

from decodeservice.engine.config import ModelConfig
from decodeservice.engine.errors import ConfigError, UnsupportedModelError
from decodeservice.engine.loader.architectures import (
    SUPPORTED_GGUF_ARCHITECTURES,
    SUPPORTED_MODEL_TYPES,
    check_hf_config,
    gguf_family,
)
from decodeservice.engine.loader.gguf_loader import read_gguf_tokenizer
from decodeservice.engine.loader.hf_loader import read_hf_config
from tests.engine.test_loader import MERGES, SPECIALS, TOKENS, save_tiny_tokenizer

# config.json of public checkpoints, as published (keys that do not matter here left out).
QWEN25 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "bos_token_id": 151643,
          "eos_token_id": 151645, "hidden_act": "silu", "max_window_layers": 21, "rms_norm_eps": 1e-06,
          "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True, "use_sliding_window": False,
          "max_position_embeddings": 32768, "vocab_size": 151936, "num_key_value_heads": 2}
LLAMA31 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "mlp_bias": False,
           "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu",
           "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 131072,
           "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
           "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192, "rope_type": "llama3"},
           "rope_theta": 500000.0, "tie_word_embeddings": False, "vocab_size": 128256}
REAL_CONFIGS: dict[str, dict[str, Any]] = {
    # examples/gpu-speculative.yaml: the target and its draft
    "Qwen/Qwen2.5-1.5B-Instruct": QWEN25 | {"hidden_size": 1536, "intermediate_size": 8960,
                                            "num_attention_heads": 12, "num_hidden_layers": 28},
    "Qwen/Qwen2.5-0.5B-Instruct": QWEN25 | {"hidden_size": 896, "intermediate_size": 4864,
                                            "num_attention_heads": 14, "num_hidden_layers": 24},
    # examples/vllm-proxy.yaml serves it with vLLM; the builtin engine loads it too
    "meta-llama/Llama-3.1-8B-Instruct": LLAMA31,
    "meta-llama/Llama-3.2-1B-Instruct": LLAMA31 | {
        "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "head_dim": 64,
        "tie_word_embeddings": True, "rope_scaling": LLAMA31["rope_scaling"] | {"factor": 32.0}},
    "Qwen/Qwen3-0.6B": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
                        "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024, "intermediate_size": 3072,
                        "max_position_embeddings": 40960, "num_attention_heads": 16, "num_hidden_layers": 28,
                        "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None,
                        "rope_theta": 1000000, "sliding_window": None, "use_sliding_window": False,
                        "tie_word_embeddings": True, "vocab_size": 151936},
    "mistralai/Mistral-7B-v0.1": {"architectures": ["MistralForCausalLM"], "model_type": "mistral",
                                  "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
                                  "max_position_embeddings": 32768, "num_attention_heads": 32,
                                  "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
                                  "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False,
                                  "vocab_size": 32000},
}


def hf_dir(path: Path, config: dict[str, Any]) -> Path:
    """A directory with this config.json and a tiny tokenizer (no weights: only the config is read)."""
    (path / "config.json").write_text(json.dumps(config))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    save_tiny_tokenizer(path)
    return path


@pytest.mark.parametrize("name", list(REAL_CONFIGS))
def test_real_checkpoints_configs_load(tmp_path: Path, name: str) -> None:
    raw = REAL_CONFIGS[name]
    config, _ = read_hf_config(hf_dir(tmp_path, raw))
    assert (config.hidden_size, config.num_layers, config.vocab_size) == (
        raw["hidden_size"], raw["num_hidden_layers"], raw["vocab_size"])
    assert config.head_dim == raw.get("head_dim", raw["hidden_size"] // raw["num_attention_heads"])
    assert config.qkv_bias is (raw["model_type"] == "qwen2") and config.qk_norm is (raw["model_type"] == "qwen3")
    assert config.tie_word_embeddings is raw["tie_word_embeddings"]
    factors = config.rope_freq_factors
    if raw["model_type"] == "llama":
        # 64 frequencies: the fastest kept, the slowest slowed by the whole factor, some blended between
        assert factors is not None and len(factors) == config.head_dim // 2
        assert factors[0] == 1.0 and factors[-1] == raw["rope_scaling"]["factor"]
        assert any(1.0 < f < raw["rope_scaling"]["factor"] for f in factors)
    else:
        assert factors is None
    # Mistral v0.1 attends through a 4096-token window: full attention is exact up to there, and no further.
    window = 4096 if name == "mistralai/Mistral-7B-v0.1" else None
    assert config.sliding_window == window
    assert config.max_position_embeddings == (window or raw["max_position_embeddings"])


@pytest.mark.parametrize("change, named", [
    ({"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"]}, "model_type 'gemma2'"),
    ({"architectures": ["Qwen2MoeForCausalLM"]}, "Qwen2MoeForCausalLM"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "RoPE scaling 'yarn'"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "RoPE scaling 'dynamic'"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"attention_bias": True}, "attention_bias=true"),
])
def test_unsupported_configs_are_refused_with_the_supported_list(change: dict[str, Any], named: str) -> None:
    with pytest.raises(UnsupportedModelError) as caught:
        check_hf_config(REAL_CONFIGS["Qwen/Qwen2.5-1.5B-Instruct"] | change, source="qwen/config.json")
    message = str(caught.value)
    assert message.startswith("qwen/config.json: ") and named in message
    assert f"model_type {', '.join(SUPPORTED_MODEL_TYPES)}" in message and "engine.kind: vllm" in message


def test_supported_lists_and_gguf_refusal() -> None:
    assert SUPPORTED_MODEL_TYPES == ("llama", "mistral", "qwen2", "qwen3")
    assert SUPPORTED_GGUF_ARCHITECTURES == ("llama", "qwen2", "qwen3")
    assert gguf_family("qwen3", source="x.gguf").qk_norm
    with pytest.raises(UnsupportedModelError, match=r"x.gguf: GGUF architecture 'gemma3'.*llama, qwen2, qwen3.*vllm"):
        gguf_family("gemma3", source="x.gguf")


@pytest.mark.parametrize("pre", ["qwen2", "tekken", "llama-bpe"])
def test_gguf_pre_tokenizers_match_transformers(tmp_path: Path, pre: str) -> None:
    """Qwen2/2.5/3 and Mistral-Nemo split digits one at a time, Llama 3 in runs of up to three: with a
    "1 2" merge, "123" is 1|2|3 for the first two and 12|3 for Llama 3, as transformers reads each file."""
    from transformers import AutoTokenizer

    path = tmp_path / f"{pre}.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2")
    tokens = TOKENS + ["12"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_merges(MERGES + ["1 2"])
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
    writer.add_eos_token_id(2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours = read_gguf_tokenizer(path)
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in ["123 the 4567", "Hello World12", " the  hell\n12"]:
        assert ours.encode(text) == theirs(text)["input_ids"], text
    twelve = tokens.index("12")
    assert (twelve in ours.encode("123")) is (pre == "llama-bpe")


def test_model_config_checks_the_family_fields() -> None:
    base = dict(vocab_size=8, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4, num_kv_heads=2,
                head_dim=16, max_position_embeddings=256)
    assert ModelConfig(**base, rope_freq_factors=(1.0,) * 8, sliding_window=256).rope_freq_factors == (1.0,) * 8
    with pytest.raises(ConfigError, match="head_dim // 2 = 8"):
        ModelConfig(**base, rope_freq_factors=(1.0,) * 16)
    with pytest.raises(ConfigError, match="positive"):
        ModelConfig(**base, rope_freq_factors=(1.0,) * 7 + (0.0,))
    with pytest.raises(ConfigError, match="sliding window 128"):
        ModelConfig(**base, sliding_window=128)
    with pytest.raises(ConfigError, match="even"):
        ModelConfig(**base | {"head_dim": 15})


@pytest.mark.parametrize("name", ["meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.2-1B-Instruct"])
def test_llama3_rotary_frequencies_equal_transformers_at_full_size(tmp_path: Path, name: str) -> None:
    """The frequencies our rotary tables turn at, for the real Llama 3.1/3.2 RoPE settings (128-wide
    heads, factor 8 or 32), against transformers' own llama3 RoPE initialisation."""
    import torch
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from decodeservice.engine.model import Rotary

    raw = REAL_CONFIGS[name]
    config, _ = read_hf_config(hf_dir(tmp_path, raw))
    theirs, scale = ROPE_INIT_FUNCTIONS["llama3"](LlamaConfig(**raw), "cpu")
    rotary = Rotary(config.head_dim, config.rope_theta, 2, config.rope_freq_factors)
    half = config.head_dim // 2
    ours = torch.atan2(rotary.sin[1, half:], rotary.cos[1, :half])  # position 1: the angle is the frequency
    assert scale == 1.0
    torch.testing.assert_close(ours, theirs.float(), rtol=2e-6, atol=0)


def write_sentencepiece_gguf(path: Path, *, add_bos: bool | None) -> Path:
    """A tiny GGUF `llama` tokenizer as llama.cpp writes Llama 2's and Mistral 7B's: '▁' for spaces, a score
    per token and no merges, <0xNN> byte tokens for what the vocabulary cannot spell."""
    pieces = ["\u2581", "t", "h", "e", "l", "o", "\u2581t", "he", "ll", "\u2581the", "ell", "\u2581h", "\u2581hell"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("add_bos", [None, False])
def test_gguf_sentencepiece_tokenizer_matches_transformers(tmp_path: Path, add_bos: bool | None) -> None:
    """Llama 2 / Mistral 7B GGUFs: merges recovered from the scores, byte fallback, BOS unless the file says no."""
    from transformers import AutoTokenizer

    path = write_sentencepiece_gguf(tmp_path / "spm.gguf", add_bos=add_bos)
    ours = read_gguf_tokenizer(path)
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in ["the hell", " the  hell\n\thello", "<s>the</s> hell", "ünï 🙂", "tell", ""]:
        ids = ours.encode(text)
        assert ids == theirs(text)["input_ids"], text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
    # merges applied (the first word gets its '▁'), bytes fell back, BOS only where the file did not say no
    the, bos = ours.token_to_id("\u2581the"), [1] if add_bos is None else []
    assert ours.encode("the") == bos + [the]
    assert ours.encode("ü") == bos + [ours.token_to_id("\u2581"), 3 + 0xC3, 3 + 0xBC]
    assert ours.bos_token_id == 1 and ours.eos_token_ids == (2,)
