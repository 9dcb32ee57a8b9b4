"""The int8 KV pool's rows: each (slot, head) row is D int8 codes followed by its fp32 scale, 4 bytes.

Why int8: at long contexts a CPU decode step is bound by the K/V it reads, and that read also evicts the
step's weights and activations from cache, which half the bytes relieve (benchmarks/kv_traffic.py,
`int8_vs_bf16_stream_step_ms` in kv_traffic_2600_cpu2.json). Why the scale inside the row: the pool stays one tensor per
layer and K/V, so every reader (the model, the runner, prefix caching, the draft runner) keeps handling
(k_cache, v_cache) pairs, and the native kernel finds a row's scale where it reads the row.

Symmetric per row over its absmax, as the row is written (attend). The step's own fresh K/V are
replaced by their dequantized values before any attention reads them, so every path sees the same
numbers: a prompt's tokens attend alike whether its prefix came from the prefix cache or was just
computed, and a verify agrees with the decode it replaces.
"""

from __future__ import annotations

from types import ModuleType

import torch

# Bytes of a row after its D codes: the fp32 scale.
SCALE_BYTES = 4


def row_width(head_dim: int) -> int:
    """The pool's last dimension for rows of `head_dim` values."""
    return head_dim + SCALE_BYTES


def quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., D) -> int8 codes (..., D) and fp32 scales (...): each row symmetric over its own absmax."""
    wide = rows.float()
    scales = wide.abs().amax(dim=-1) / 127
    codes = torch.round(wide / scales.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)).clamp_(-127, 127)
    return codes.to(torch.int8), scales


def pack_rows(rows: torch.Tensor) -> torch.Tensor:
    """(..., D) -> (..., D + 4) int8: the codes, then the scale's bytes."""
    codes, scales = quantize_rows(rows)
    return torch.cat([codes, scales.unsqueeze(-1).view(torch.int8)], dim=-1)


def unpack_rows(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(..., D + 4) int8 -> (..., D) in `dtype`, the product taken in fp32 (as the native kernel does)."""
    d = packed.shape[-1] - SCALE_BYTES
    scales = packed[..., d:].contiguous().view(torch.float32)  # (..., 1)
    return (packed[..., :d].float() * scales).to(dtype)


def write_rows(rows: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor, module: ModuleType | None) -> torch.Tensor:
    """Pack rows (N, Hkv, D) into the pool (NB, BS, Hkv, D + 4) at slots (N,); -> their dequantized values.

    `module`: the native extension (native_decode.py) does it in one call, bit for bit as the torch ops
    below (checked when it is built); None, or rows it does not take, run those ops.
    """
    if module is not None and rows.dtype in (torch.float32, torch.bfloat16) and pool.is_cpu:
        out = torch.empty_like(rows, memory_format=torch.contiguous_format)
        module.write_int8_rows(rows.contiguous(), pool, slots, out)
        return out
    packed = pack_rows(rows)
    pool.view(-1, *pool.shape[2:]).index_copy_(0, slots, packed)
    return unpack_rows(packed, rows.dtype)
