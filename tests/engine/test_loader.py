"""engine/loader: the registry, the GGUF loader (bundled model and tiny written ones) and the HF loader."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from tokenizers import pre_tokenizers

from decodeservice.engine.errors import ModelLoadError, UnknownModelError, UnsupportedModelError
from decodeservice.engine.loader import (
    KNOWN_MODELS,
    LoadedModel,
    ensure_model,
    load_model,
    model_cache_dir,
    pull,
    resolve_model_path,
)

Q = gguf.GGMLQuantizationType
LAYER_WEIGHTS = (
    "input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
)


# -- the bundled model ------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def smollm2(bundled_gguf_path: Path) -> LoadedModel:
    return load_model(bundled_gguf_path, dtype=torch.float32)


@pytest.fixture(scope="session")
def hf_state_dict(bundled_gguf_path: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(bundled_gguf_path.parent), gguf_file=bundled_gguf_path.name, dtype=torch.float32
    )
    return dict(model.state_dict())


@pytest.mark.model
def test_bundled_config(smollm2: LoadedModel) -> None:
    c = smollm2.config
    assert (c.num_layers, c.hidden_size, c.intermediate_size) == (30, 576, 1536)
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (9, 3, 64)
    assert c.vocab_size == 49152 and c.tie_word_embeddings
    assert c.rope_theta == 100000.0 and c.max_position_embeddings == 8192
    assert c.rms_norm_eps == pytest.approx(1e-5)
    assert c.bos_token_id == 1 and c.eos_token_ids == (2,)  # <|im_start|>, <|im_end|>


@pytest.mark.model
def test_bundled_weight_names_and_shapes(smollm2: LoadedModel) -> None:
    expected = {"model.embed_tokens.weight": (49152, 576), "model.norm.weight": (576,)}
    per_layer = {
        "input_layernorm": (576,), "post_attention_layernorm": (576,),
        "self_attn.q_proj": (576, 576), "self_attn.k_proj": (192, 576), "self_attn.v_proj": (192, 576),
        "self_attn.o_proj": (576, 576),
        "mlp.gate_proj": (1536, 576), "mlp.up_proj": (1536, 576), "mlp.down_proj": (576, 1536),
    }
    for i in range(30):
        expected |= {f"model.layers.{i}.{name}.weight": shape for name, shape in per_layer.items()}
    assert {name: tuple(w.shape) for name, w in smollm2.weights.items()} == expected  # tied: no lm_head
    assert all(w.dtype == torch.float32 and w.is_contiguous() for w in smollm2.weights.values())


@pytest.mark.model
def test_bundled_weights_equal_transformers(smollm2: LoadedModel, hf_state_dict: dict[str, torch.Tensor]) -> None:
    # transformers' state dict also lists the tied lm_head; it is the embedding itself.
    assert set(hf_state_dict) - {"lm_head.weight"} == set(smollm2.weights)
    for name, ours in smollm2.weights.items():
        # q/k included: equal only if llama.cpp's RoPE row permutation was undone.
        theirs = hf_state_dict[name]
        assert ours.shape == theirs.shape and float((ours - theirs).abs().max()) <= 1e-6, name


# -- registry -----------------------------------------------------------------------------------------


def test_cache_dir_precedence(tmp_path: Path) -> None:
    env = {"DECODESERVICE_MODEL_CACHE": str(tmp_path / "env")}
    assert model_cache_dir(tmp_path / "flag", environ=env) == tmp_path / "flag"
    assert model_cache_dir(None, environ=env) == tmp_path / "env"
    assert model_cache_dir(None, environ={}) == Path.home() / ".cache" / "decodeservice" / "models"


def test_unknown_model_name_lists_known_ones() -> None:
    with pytest.raises(UnknownModelError, match="smollm2-135m"):
        resolve_model_path("no-such-model")
    with pytest.raises(UnknownModelError, match="smollm2-135m"):
        ensure_model("no-such-model")


def test_resolve_model_path_accepts_files_and_hf_dirs(tmp_path: Path) -> None:
    gguf_file = write_tiny_gguf(tmp_path / "tiny.gguf")[0]
    assert resolve_model_path(str(gguf_file)) == gguf_file
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    with pytest.raises(UnknownModelError):  # a folder without config.json is not a model
        resolve_model_path(str(hf_dir))
    (hf_dir / "config.json").write_text("{}")
    assert resolve_model_path(str(hf_dir)) == hf_dir
    with pytest.raises(UnknownModelError):
        load_model(tmp_path / "missing.gguf")


@pytest.mark.model
def test_corrupt_cached_file_is_pulled_again(tmp_path: Path, bundled_gguf_path: Path) -> None:
    cached = tmp_path / bundled_gguf_path.name
    shutil.copyfile(bundled_gguf_path, cached)
    with open(cached, "r+b") as f:  # same size, one flipped byte: only the hash can tell
        f.seek(1_000_000)
        byte = f.read(1)
        f.seek(1_000_000)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert ensure_model("smollm2-135m", cache_dir=tmp_path, progress=False) == cached
    assert cached.read_bytes() == bundled_gguf_path.read_bytes()
    assert [p.name for p in tmp_path.iterdir()] == [cached.name]  # no temp files left behind


@pytest.mark.model
def test_pull_rejects_a_file_with_the_wrong_hash(tmp_path: Path) -> None:
    wrong = replace(KNOWN_MODELS["smollm2-135m"], sha256="0" * 64)
    with pytest.raises(ModelLoadError, match="expected 0000"):
        pull(wrong, cache_dir=tmp_path, progress=False)
    assert list(tmp_path.iterdir()) == []  # nothing half-written is left in the cache


# -- tiny GGUF files ----------------------------------------------------------------------------------

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 64, 128, 4, 2, 2
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "l l", "e ll"]
TOKENS = SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet()) + ["Ġt", "he", "Ġthe", "ll", "ell"]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
# The qtype each weight is written with: every supported type appears; q/k are exact (F32) so the
# RoPE un-permutation is checked bit for bit.
QTYPES = {
    "token_embd": Q.Q8_0, "output": Q.F16, "attn_q": Q.F32, "attn_k": Q.F32, "attn_v": Q.Q4_0,
    "attn_output": Q.Q4_1, "ffn_gate": Q.Q8_0, "ffn_up": Q.F16, "ffn_down": Q.Q4_1,
}
HF_NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to q/k rows (LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(
    path: Path, *, arch: str = "llama", tied: bool = False, add_bos: bool = False,
    qtypes: dict[str, Any] | None = None,
) -> tuple[Path, dict[str, np.ndarray], dict[str, Any]]:
    """A random 2-layer llama; returns the file, the HF-named float32 weights it holds, and the qtypes."""
    rng = np.random.default_rng(0)
    qtypes = QTYPES | (qtypes or {})
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(500000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(TOKENS)
    writer.add_token_merges(MERGES)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(TOKENS) - len(SPECIALS)))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(TEMPLATE)

    weights: dict[str, np.ndarray] = {}
    used: dict[str, Any] = {}

    def add(gguf_name: str, hf_name: str, shape: tuple[int, ...], kind: str) -> None:
        w = rng.standard_normal(shape).astype(np.float32)
        weights[hf_name] = w
        stored = w
        if kind == "attn_q":
            stored = llama_cpp_permute(w, HEADS)
        elif kind == "attn_k":
            stored = llama_cpp_permute(w, KV_HEADS)
        qtype = qtypes.get(kind, Q.F32)
        used[hf_name] = qtype
        if qtype == Q.F32:
            writer.add_tensor(gguf_name, stored)
        elif qtype == Q.F16:
            writer.add_tensor(gguf_name, stored.astype(np.float16))
        else:
            writer.add_tensor(gguf_name, gguf.quants.quantize(stored, qtype), raw_dtype=qtype)

    vocab = len(TOKENS)
    add("token_embd.weight", "model.embed_tokens.weight", (vocab, HIDDEN), "token_embd")
    kv = HIDDEN // HEADS * KV_HEADS
    shapes = {"attn_norm": (HIDDEN,), "attn_q": (HIDDEN, HIDDEN), "attn_k": (kv, HIDDEN), "attn_v": (kv, HIDDEN),
              "attn_output": (HIDDEN, HIDDEN), "ffn_norm": (HIDDEN,), "ffn_gate": (FFN, HIDDEN),
              "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}
    for i in range(LAYERS):
        for kind, shape in shapes.items():
            add(f"blk.{i}.{kind}.weight", f"model.layers.{i}.{HF_NAMES[kind]}.weight", shape, kind)
    add("output_norm.weight", "model.norm.weight", (HIDDEN,), "output_norm")
    if not tied:
        add("output.weight", "lm_head.weight", (vocab, HIDDEN), "output")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, weights, used


def assert_dequantized(ours: torch.Tensor, original: np.ndarray, qtype: Any, name: str) -> None:
    want = torch.from_numpy(original)
    if qtype == Q.F32:
        torch.testing.assert_close(ours, want, rtol=0, atol=0, msg=name)
    elif qtype == Q.F16:
        torch.testing.assert_close(ours, torch.from_numpy(original.astype(np.float16)).float(), rtol=0, atol=0)
    else:
        # Block quantization: each error is at most about one step of its 32-value block.
        levels = {Q.Q8_0: 127, Q.Q4_0: 8, Q.Q4_1: 15}[qtype]
        blocks = want.reshape(-1, 32)
        step = blocks.abs().amax(dim=1, keepdim=True) * (2 if qtype == Q.Q4_1 else 1) / levels
        err = (ours.reshape(-1, 32) - blocks).abs()
        assert bool((err <= step * 1.01 + 1e-6).all()), f"{name}: dequantization error beyond one step"


@pytest.mark.parametrize("tied", [False, True])
def test_tiny_gguf_round_trips(tmp_path: Path, tied: bool) -> None:
    path, weights, qtypes = write_tiny_gguf(tmp_path / "tiny.gguf", tied=tied)
    loaded = load_model(path)
    c = loaded.config
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers) == (len(TOKENS), HIDDEN, FFN, LAYERS)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.rope_theta) == (HEADS, KV_HEADS, 16, 500000.0)
    assert c.max_position_embeddings == 256 and c.rms_norm_eps == pytest.approx(1e-6)
    assert c.tie_word_embeddings is tied and c.bos_token_id == 1 and c.eos_token_ids == (2,)
    assert set(loaded.weights) == set(weights)
    for name, original in weights.items():
        assert_dequantized(loaded.weights[name], original, qtypes[name], name)
    # The tokenizer came along: specials stay whole, merges apply, no BOS unless the file asks.
    tok = loaded.tokenizer
    ids = {t: TOKENS.index(t) for t in ("t", "he", "Ġthe", "Ġ", "ll", "Ġt", "ell")}
    assert tok.encode("<|im_start|>the") == [1, ids["t"], ids["he"]]
    assert tok.encode(" the hell tell") == [ids[t] for t in ("Ġthe", "Ġ", "he", "ll", "Ġt", "ell")]
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<|im_start|>user\nhi<|im_end|>\n"


def test_tiny_gguf_dtype(tmp_path: Path) -> None:
    path, weights, _ = write_tiny_gguf(tmp_path / "tiny.gguf")
    loaded = load_model(path, dtype=torch.bfloat16)
    assert all(w.dtype == torch.bfloat16 and w.is_contiguous() for w in loaded.weights.values())
    q = "model.layers.1.self_attn.q_proj.weight"
    assert torch.equal(loaded.weights[q], torch.from_numpy(weights[q]).to(torch.bfloat16))


def test_tiny_gguf_tokenizer_matches_transformers(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    path = write_tiny_gguf(tmp_path / "tiny.gguf", add_bos=True)[0]
    ours = load_model(path).tokenizer
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in ["the hell", " the  the\n\tell", "<|im_start|>x<|im_end|>", "ünï 🙂", ""]:
        assert ours.encode(text) == theirs(text)["input_ids"], text
        assert ours.encode(text)[:1] == [1]  # the file asks for BOS
        assert ours.encode(text, add_special_tokens=False) == theirs(text, add_special_tokens=False)["input_ids"]


def test_truncated_gguf_is_unsupported(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf")[0]
    data = path.read_bytes()
    for keep in (10, 300, len(data) // 2, len(data) - 100):
        cut = tmp_path / f"cut{keep}.gguf"
        cut.write_bytes(data[:keep])
        with pytest.raises(UnsupportedModelError, match="cut"):
            load_model(cut)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(UnsupportedModelError):
        load_model(junk)


def test_wrong_architecture_is_unsupported(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf", arch="gpt2")[0]
    with pytest.raises(UnsupportedModelError, match="architecture 'gpt2'"):
        load_model(path)


def test_unsupported_tensor_type_is_named(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf", qtypes={"ffn_up": Q.Q5_0})[0]
    with pytest.raises(UnsupportedModelError, match="Q5_0"):
        load_model(path)


# -- HF directories -----------------------------------------------------------------------------------


def write_tiny_hf_dir(path: Path, *, tied: bool) -> dict[str, torch.Tensor]:
    """A random LlamaForCausalLM saved by transformers itself, plus a tokenizer built with `tokenizers`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(TOKENS), hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=128,
                         rope_theta=20000.0, tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    save_tiny_tokenizer(path)
    return dict(model.state_dict())


def save_tiny_tokenizer(path: Path) -> None:
    """tokenizer.json (byte-level BPE over TOKENS), tokenizer_config.json with the chat template, and two
    EOS ids in the generation_config.json that save_pretrained wrote."""
    from tokenizers import AddedToken, Tokenizer, decoders, processors
    from tokenizers.models import BPE

    merges = [(left, right) for left, _, right in (m.partition(" ") for m in MERGES)]
    backend = Tokenizer(BPE(vocab={t: i for i, t in enumerate(TOKENS)}, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    backend.post_processor = processors.TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>",
        "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "special": True}, "chat_template": TEMPLATE,
    }))
    generation = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps(generation | {"eos_token_id": [2, 0]}))


@pytest.mark.parametrize("tied", [False, True])
def test_tiny_hf_dir_loads(tmp_path: Path, tied: bool) -> None:
    state = write_tiny_hf_dir(tmp_path, tied=tied)
    loaded = load_model(tmp_path, dtype=torch.float32)
    c = loaded.config
    assert (c.vocab_size, c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads) == (
        len(TOKENS), HIDDEN, LAYERS, HEADS, KV_HEADS)
    assert c.rope_theta == 20000.0 and c.max_position_embeddings == 128 and c.tie_word_embeddings is tied
    assert c.bos_token_id == 1 and c.eos_token_ids == (2, 0)  # tokenizer_config's eos, then generation_config's
    assert set(loaded.weights) == set(state) - ({"lm_head.weight"} if tied else set())
    for name, weight in loaded.weights.items():
        assert torch.equal(weight, state[name]), name
    assert loaded.tokenizer.encode("the") == [1, TOKENS.index("t"), TOKENS.index("he")]


def test_hf_dir_with_other_architecture_is_unsupported(tmp_path: Path) -> None:
    write_tiny_hf_dir(tmp_path, tied=True)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"model_type": "gpt_neox",
                                                                 "architectures": ["GPTNeoXForCausalLM"]}))
    with pytest.raises(UnsupportedModelError, match="gpt_neox.*llama, mistral, qwen2, qwen3.*engine.kind: vllm"):
        load_model(tmp_path)
    # A supported model_type whose weights are another family's: Qwen2 has q/k/v biases, Llama does not.
    (tmp_path / "config.json").write_text(json.dumps(config | {"model_type": "qwen2",
                                                                 "architectures": ["Qwen2ForCausalLM"]}))
    with pytest.raises(UnsupportedModelError, match="missing .*q_proj.bias"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config | {"num_hidden_layers": LAYERS + 1}))
    with pytest.raises(UnsupportedModelError, match="missing"):
        load_model(tmp_path)
