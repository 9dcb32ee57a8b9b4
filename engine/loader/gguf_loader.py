"""Load a llama-architecture GGUF file: config from metadata, dequantized weights, tokenizer.

llama.cpp's converter stores q_proj/k_proj rows permuted for its interleaved ("GPT-J style") RoPE;
our model uses HF's rotate_half RoPE, so those rows are permuted back here, exactly as transformers'
GGUF loader does (`reverse_permute`). Everything else is a rename plus a dequantize.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from decodeservice.engine.config import ModelConfig
from decodeservice.engine.errors import ConfigError, UnsupportedModelError
from decodeservice.engine.loader import LoadedModel, check_weights
from decodeservice.engine.quant.int4 import Int4Weight, int4_from_gguf
from decodeservice.engine.tokenizer import Tokenizer

Q = gguf.GGMLQuantizationType
SUPPORTED_TYPES = frozenset({Q.F32, Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1})

# GGUF tensor name -> HF name; "{i}" is the layer index.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Errors numpy/struct raise on a truncated or garbled file; reported as UnsupportedModelError.
_PARSE_ERRORS = (ValueError, KeyError, IndexError, struct.error, OverflowError, EOFError, UnicodeDecodeError)


def read_gguf_tokenizer(path: Path) -> Tokenizer:
    """Only the tokenizer of a GGUF file (no weights are dequantized)."""
    _, metadata = _open(path)
    return _tokenizer(metadata, path)


def _tokenizer(metadata: dict[str, Any], path: Path) -> Tokenizer:
    try:
        return Tokenizer.from_gguf_metadata({k: v for k, v in metadata.items() if k.startswith("tokenizer.")})
    except _PARSE_ERRORS as exc:  # e.g. a corrupted key name: found by tests/reliability/test_fuzz.py
        raise UnsupportedModelError(f"{path}: incomplete or corrupt tokenizer metadata: {exc!r}") from exc


def _open(path: Path) -> tuple[gguf.GGUFReader, dict[str, Any]]:
    try:
        reader = gguf.GGUFReader(path)
    except _PARSE_ERRORS as exc:
        raise UnsupportedModelError(f"{path} is not a readable GGUF file (truncated or corrupt?): {exc}") from exc
    try:
        return reader, {name: field.contents() for name, field in reader.fields.items()}
    except _PARSE_ERRORS as exc:
        raise UnsupportedModelError(f"{path}: corrupt GGUF metadata: {exc}") from exc


def load_gguf(path: Path, *, dtype: torch.dtype, native_int4: bool = False) -> LoadedModel:
    reader, metadata = _open(path)
    arch = metadata.get("general.architecture")
    if arch != "llama":
        raise UnsupportedModelError(f"{path}: architecture {arch!r} is not supported; only 'llama' is")
    tensors = {t.name: t for t in reader.tensors}
    scaling = metadata.get("llama.rope.scaling.type", "none")
    if "rope_freqs.weight" in tensors or scaling != "none":
        # Scaled RoPE (linear, yarn, Llama-3.1 frequency factors) is not what the model code implements.
        raise UnsupportedModelError(f"{path}: RoPE scaling ({scaling}) is not supported")

    tokenizer = _tokenizer(metadata, path)
    config = _config(metadata, tensors, tokenizer, path=path)

    weights: dict[str, torch.Tensor] = {}
    int4: dict[str, Int4Weight] = {}
    for gguf_name, tensor in tensors.items():
        hf_name = _hf_name(gguf_name)
        if hf_name is None:
            raise UnsupportedModelError(f"{path}: unexpected tensor {gguf_name!r} for a llama model")
        heads = (config.num_heads if hf_name.endswith("q_proj.weight")
                 else config.num_kv_heads if hf_name.endswith("k_proj.weight") else None)
        if native_int4 and Q(tensor.tensor_type) in (Q.Q4_0, Q.Q4_1) and len(tensor.shape) == 2:
            packed = _read_int4(tensor, path=path)
            int4[hf_name] = packed if heads is None else packed.select_rows(_unpermute_rope_index(packed.shape[0], heads))
            continue
        weight = _dequantize(tensor, path=path)
        if heads is not None:
            weight = weight[_unpermute_rope_index(weight.shape[0], heads)]
        weights[hf_name] = weight.to(dtype).contiguous()
    check_weights({**weights, **int4}, config, source=path)
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer, int4=int4)


def _config(
    metadata: dict[str, Any], tensors: dict[str, gguf.ReaderTensor], tokenizer: Tokenizer, *, path: Path
) -> ModelConfig:
    def get(key: str) -> Any:
        value = metadata.get(f"llama.{key}")
        if value is None:
            raise UnsupportedModelError(f"{path}: GGUF metadata has no llama.{key}")
        return value

    hidden = int(get("embedding_length"))
    num_heads = int(get("attention.head_count"))
    head_dim = int(metadata.get("llama.attention.key_length", hidden // max(num_heads, 1)))
    rope_dim = int(metadata.get("llama.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise UnsupportedModelError(f"{path}: partial RoPE (rope dim {rope_dim} < head dim {head_dim}) is not supported")
    embed = tensors.get("token_embd.weight")
    if embed is None:
        raise UnsupportedModelError(f"{path}: no token_embd.weight tensor")
    # The logits width is the embedding's row count; the token list may be shorter (padded embeddings),
    # never longer.
    vocab_size = int(embed.shape[-1])
    num_tokens = len(metadata.get("tokenizer.ggml.tokens", []))
    if num_tokens > vocab_size:
        raise UnsupportedModelError(f"{path}: {num_tokens} tokens but only {vocab_size} embedding rows")
    try:
        return ModelConfig(
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_layers=int(get("block_count")),
            num_heads=num_heads,
            num_kv_heads=int(metadata.get("llama.attention.head_count_kv", num_heads)),
            head_dim=head_dim,
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
            rope_theta=float(metadata.get("llama.rope.freq_base", 10000.0)),
            max_position_embeddings=int(get("context_length")),
            tie_word_embeddings="output.weight" not in tensors,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_ids=tokenizer.eos_token_ids,
        )
    except (ConfigError, ZeroDivisionError) as exc:
        raise UnsupportedModelError(f"{path}: inconsistent GGUF metadata: {exc}") from exc


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[3] == "weight":
        layer = _LAYER_NAMES.get(parts[2])
        if layer is not None:
            return f"model.layers.{parts[1]}.{layer}.weight"
    return None


def _dequantize(tensor: gguf.ReaderTensor, *, path: Path) -> torch.Tensor:
    qtype = Q(tensor.tensor_type)
    if qtype not in SUPPORTED_TYPES:
        supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise UnsupportedModelError(f"{path}: tensor {tensor.name} has type {qtype.name}; supported: {supported}")
    # GGUF lists dimensions innermost first; reversed, that is torch's [out_features, in_features].
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    try:
        array = gguf.quants.dequantize(tensor.data, qtype).reshape(shape)
    except _PARSE_ERRORS as exc:
        raise UnsupportedModelError(f"{path}: tensor {tensor.name} is truncated or corrupt: {exc}") from exc
    if not array.flags.writeable:  # F32 tensors are read-only views of the memory-mapped file
        array = array.copy()
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))


def _read_int4(tensor: gguf.ReaderTensor, *, path: Path) -> Int4Weight:
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    try:
        return int4_from_gguf(tensor.data, is_q4_1=Q(tensor.tensor_type) == Q.Q4_1, shape=(shape[0], shape[1]))
    except _PARSE_ERRORS as exc:
        raise UnsupportedModelError(f"{path}: tensor {tensor.name} is truncated or corrupt: {exc}") from exc


def _unpermute_rope_index(rows: int, n_head: int) -> torch.Tensor:
    """Row order undoing llama.cpp's `permute`: within each head it stores the rows as interleaved
    (x0, x_half, x1, ...) pairs; HF's rotate_half wants the first half of the head's rows, then the
    second half. An index, so dense and 4-bit weights (rows of codes and scales) reorder alike."""
    if rows % (2 * n_head):
        raise UnsupportedModelError(f"{rows} q/k rows do not split into {n_head} heads of even size")
    # (n_head, head_dim/2, 2) -> (n_head, 2, head_dim/2)
    return torch.arange(rows).reshape(n_head, rows // n_head // 2, 2).swapaxes(1, 2).reshape(rows)
