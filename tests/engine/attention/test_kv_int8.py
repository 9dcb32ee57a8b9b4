"""int8 KV pools (kv_int8.py): every backend that takes them equals dense attention over the values they hold."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

from decodeservice.engine.attention import AttentionBackend, StepAttention, attend, kv_int8, native_decode
from decodeservice.engine.attention.gather import GatherBackend
from decodeservice.engine.attention.paged_views import PagedViewsBackend
from tests.engine.attention.test_backends import HKV, SEQUENCES, build_step


def dense_over_pool(q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, step: StepAttention) -> torch.Tensor:
    """Causal attention in float64 over the keys each sequence's table points at, as the pool holds them."""
    outs = []
    block_size = step.meta.block_size
    for span in step.meta.spans:
        length, cached = span.context_len, span.context_len - span.num_new
        table = span.block_table.tolist()
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(length)])
        keys, values = k_flat[slots].transpose(0, 1), v_flat[slots].transpose(0, 1)  # (Hkv, L, D)
        visible = torch.arange(length).unsqueeze(0) <= (torch.arange(span.num_new) + cached).unsqueeze(1)
        queries = q[span.token_start : span.token_start + span.num_new].double().transpose(0, 1)
        outs.append(F.scaled_dot_product_attention(queries, keys, values, attn_mask=visible,
                                                   enable_gqa=True).transpose(0, 1))
    return torch.cat(outs)


def int8_step(dtype: torch.dtype, backend: AttentionBackend, *, head_dim: int
              ) -> tuple[StepAttention, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    step, q, k, v, k_cache, v_cache, _ = build_step(dtype, backend, head_dim=head_dim)
    assert not isinstance(backend, PagedViewsBackend) or backend.kv_int8  # told so at construction, as the engine does
    planned = StepAttention(meta=backend.plan(step.meta, dtype=dtype), backend=backend)
    return planned, q, k, v, kv_int8.pack_rows(k_cache), kv_int8.pack_rows(v_cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend_name", ["paged_views", "paged_views_native", "paged_views_native_decodes", "gather"])
def test_int8_pools_equal_dense_attention_over_their_values(dtype: torch.dtype, backend_name: str,
                                                            request: pytest.FixtureRequest) -> None:
    # Decodes, prompt chunks over a cached prefix and verifies, over one run, a few and a scattered table; the
    # step's own K/V are quantized on write and read back as the pool holds them, like every older key.
    backend: AttentionBackend
    if backend_name == "gather":
        backend, head_dim = GatherBackend(), 8
    else:
        module = request.getfixturevalue("kernel") if backend_name.startswith("paged_views_native") else None
        # paged_views_native_decodes: verifies over the plain path's dequantized copy of their keys
        backend, head_dim = PagedViewsBackend(kernel=module, kv_int8=True, kernel_max_new=1
                                              if backend_name == "paged_views_native_decodes" else native_decode.MAX_NEW), 64
    step, q, k, v, k_pool, v_pool = int8_step(dtype, backend, head_dim=head_dim)
    out = attend(q, k, v, k_pool, v_pool, step)
    assert k_pool.dtype == torch.int8 and k_pool.shape[-1] == kv_int8.row_width(head_dim)
    k_flat, v_flat = (kv_int8.unpack_rows(p.view(-1, HKV, p.shape[-1]), torch.float64) for p in (k_pool, v_pool))
    reference = dense_over_pool(q, k_flat, v_flat, step)
    assert out.dtype == dtype and out.shape == q.shape
    # fp32: the kernels' arithmetic; bf16: the output's and the dequantized keys' roundings, as for bf16 pools.
    torch.testing.assert_close(out.double(), reference, atol=1e-4 if dtype == torch.float32 else 3e-2, rtol=0)
    if backend_name == "paged_views_native":
        meta = step.meta
        assert meta.decode_group is not None and len(meta.decode_group.span_indices) == sum(
            q <= native_decode.MAX_NEW for q, _, _ in SEQUENCES)


def test_a_step_writes_int8_rows_that_hold_the_keys_within_their_rounding() -> None:
    step, q, k, v, k_pool, v_pool = int8_step(torch.float32, GatherBackend(), head_dim=8)
    attend(q, k, v, k_pool, v_pool, step)
    written = kv_int8.unpack_rows(k_pool.view(-1, HKV, k_pool.shape[-1])[step.meta.slot_mapping], torch.float32)
    half_step = k.abs().amax(dim=-1, keepdim=True) / 127 / 2  # (N, Hkv, 1): half a code of each row
    assert bool(((written - k).abs() <= half_step * (1 + 1e-5)).all())
    assert not torch.equal(written, k)  # randn values are not on the grid: the rows were rounded


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_native_write_packs_bit_for_bit_as_the_torch_ops(kernel: ModuleType, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    rows = (torch.randn(37, HKV, 64, generator=gen) * torch.logspace(-4, 2, 37).view(-1, 1, 1)).to(dtype)
    rows[5].zero_()
    rows[9, 0, 7] = 1e30  # one huge value: every other code of its row rounds to 0
    slots = torch.randperm(4 * 16, generator=gen)[:37]
    pools = [torch.zeros(4, 16, HKV, kv_int8.row_width(64), dtype=torch.int8) for _ in range(2)]
    native = kv_int8.write_rows(rows, pools[0], slots, kernel)
    reference = kv_int8.write_rows(rows, pools[1], slots, None)
    assert torch.equal(pools[0], pools[1]) and torch.equal(native, reference)
    assert native.dtype == dtype and torch.equal(native, kv_int8.unpack_rows(pools[0].flatten(0, 1)[slots], dtype))
