"""Load a GGUF file (architecture llama, qwen2 or qwen3): config from metadata, weights, tokenizer.

Metadata keys and tensor names are the gguf library's constants (gguf.Keys, gguf.TENSOR_NAMES), read
for the file's own architecture. For `llama` (which Mistral converts to as well), llama.cpp's converter
stores q_proj/k_proj rows permuted for its interleaved ("GPT-J style") RoPE; our model uses HF's
rotate_half RoPE, so those rows are permuted back here, exactly as transformers' GGUF loader does
(`reverse_permute`). qwen2/qwen3 run llama.cpp's NEOX RoPE, which is rotate_half: nothing to undo.
Llama 3.x RoPE scaling arrives as the `rope_freqs` tensor (one divisor per frequency). Everything
else is a rename plus a dequantize.
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
from decodeservice.engine.loader.architectures import gguf_family
from decodeservice.engine.quant.int4 import Int4Weight, int4_from_gguf
from decodeservice.engine.tokenizer import Tokenizer

Q = gguf.GGMLQuantizationType
T = gguf.MODEL_TENSOR
SUPPORTED_TYPES = frozenset({Q.F32, Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1})

# GGUF tensor name -> HF name.
_GLOBAL_NAMES = {
    f"{gguf.TENSOR_NAMES[T.TOKEN_EMBD]}.weight": "model.embed_tokens.weight",
    f"{gguf.TENSOR_NAMES[T.OUTPUT_NORM]}.weight": "model.norm.weight",
    f"{gguf.TENSOR_NAMES[T.OUTPUT]}.weight": "lm_head.weight",
}
_ROPE_FREQS = f"{gguf.TENSOR_NAMES[T.ROPE_FREQS]}.weight"  # (D/2,) Llama 3.x frequency divisors, not a weight
# Per-layer tensor ("blk.{bid}.<kind>.<weight|bias>") -> HF module under model.layers.{bid}.
_LAYER_NAMES = {
    gguf.TENSOR_NAMES[tensor].removeprefix("blk.{bid}."): hf_name
    for tensor, hf_name in (
        (T.ATTN_NORM, "input_layernorm"),
        (T.ATTN_Q, "self_attn.q_proj"),
        (T.ATTN_K, "self_attn.k_proj"),
        (T.ATTN_V, "self_attn.v_proj"),
        (T.ATTN_OUT, "self_attn.o_proj"),
        (T.ATTN_Q_NORM, "self_attn.q_norm"),  # qwen3
        (T.ATTN_K_NORM, "self_attn.k_norm"),  # qwen3
        (T.FFN_NORM, "post_attention_layernorm"),
        (T.FFN_GATE, "mlp.gate_proj"),
        (T.FFN_UP, "mlp.up_proj"),
        (T.FFN_DOWN, "mlp.down_proj"),
    )
}
_GLOBAL_NAMES_BY_HF = {hf: name for name, hf in _GLOBAL_NAMES.items()}
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
    arch = metadata.get(gguf.Keys.General.ARCHITECTURE)
    gguf_family(arch, source=str(path))
    tensors = {t.name: t for t in reader.tensors}
    scaling = metadata.get(gguf.Keys.Rope.SCALING_TYPE.format(arch=arch), "none")
    if scaling != "none":
        # linear, yarn, ...: not what the model code implements (Llama 3.x comes as rope_freqs instead).
        raise UnsupportedModelError(f"{path}: RoPE scaling {scaling!r} is not supported")

    tokenizer = _tokenizer(metadata, path)
    config = _config(metadata, tensors, tokenizer, arch=str(arch), path=path)

    weights: dict[str, torch.Tensor] = {}
    int4: dict[str, Int4Weight] = {}
    for gguf_name, tensor in tensors.items():
        if gguf_name == _ROPE_FREQS:
            continue  # read into config.rope_freq_factors
        hf_name = _hf_name(gguf_name)
        if hf_name is None:
            raise UnsupportedModelError(f"{path}: unexpected tensor {gguf_name!r} for a {arch} model")
        permuted = arch == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight"))
        heads = (None if not permuted else config.num_heads if hf_name.endswith("q_proj.weight")
                 else config.num_kv_heads)
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
    metadata: dict[str, Any], tensors: dict[str, gguf.ReaderTensor], tokenizer: Tokenizer, *, arch: str, path: Path
) -> ModelConfig:
    family = gguf_family(arch, source=str(path))

    def get(key: str, default: Any = None) -> Any:  # key: a gguf.Keys template, "{arch}.context_length"
        value = metadata.get(key.format(arch=arch), default)
        if value is None:
            raise UnsupportedModelError(f"{path}: GGUF metadata has no {key.format(arch=arch)}")
        return value

    K, A = gguf.Keys.LLM, gguf.Keys.Attention
    hidden = int(get(K.EMBEDDING_LENGTH))
    num_heads = int(get(A.HEAD_COUNT))
    head_dim = int(get(A.KEY_LENGTH, hidden // max(num_heads, 1)))
    rope_dim = int(get(gguf.Keys.Rope.DIMENSION_COUNT, head_dim))
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
    freqs = tensors.get(_ROPE_FREQS)
    window = metadata.get(A.SLIDING_WINDOW.format(arch=arch))
    max_positions = int(get(K.CONTEXT_LENGTH))
    try:
        return ModelConfig(
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=int(get(K.FEED_FORWARD_LENGTH)),
            num_layers=int(get(K.BLOCK_COUNT)),
            num_heads=num_heads,
            num_kv_heads=int(get(A.HEAD_COUNT_KV, num_heads)),
            head_dim=head_dim,
            rms_norm_eps=float(get(A.LAYERNORM_RMS_EPS)),
            rope_theta=float(get(gguf.Keys.Rope.FREQ_BASE, 10000.0)),
            # Attention here is full: a sliding-window model is exact while its context fits in the window.
            max_position_embeddings=max_positions if window is None else min(max_positions, int(window)),
            tie_word_embeddings=_GLOBAL_NAMES_BY_HF["lm_head.weight"] not in tensors,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_ids=tokenizer.eos_token_ids,
            qkv_bias=family.qkv_bias,
            qk_norm=family.qk_norm,
            rope_freq_factors=None if freqs is None else tuple(_dequantize(freqs, path=path).flatten().tolist()),
            sliding_window=None if window is None else int(window),
        )
    except (ConfigError, ZeroDivisionError) as exc:
        raise UnsupportedModelError(f"{path}: inconsistent GGUF metadata: {exc}") from exc


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[3] in ("weight", "bias"):
        layer = _LAYER_NAMES.get(parts[2])
        if layer is not None:
            return f"model.layers.{parts[1]}.{layer}.{parts[3]}"
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
