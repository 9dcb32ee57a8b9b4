"""attention/native_decode.py: the native paged-decode kernel equals float64 attention over the pool, refuses
bad tables, and the CPU backend hands it exactly the step's one-token decodes."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

from decodeservice.engine.attention import StepAttention, attend, kv_int8, native_decode
from decodeservice.engine.attention.paged_views import PagedViewsBackend
from tests.engine.attention.test_backends import SEQUENCES, build_step


def random_pool(gen: torch.Generator, *, lengths: list[int], heads: int, kv_heads: int, head_dim: int,
                block_size: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Caches with scattered, unequal tables (blocks in shuffled pool order) and one query per sequence."""
    widths = [-(-n // block_size) for n in lengths]
    num_blocks = sum(widths) + 3
    k_cache, v_cache = ((torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen) * 3).to(dtype)
                        for _ in range(2))
    order = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    tables = torch.zeros(len(lengths), max(widths), dtype=torch.int32)
    start = 0
    for row, width in enumerate(widths):
        tables[row, :width] = order[start : start + width]
        start += width
    q = (torch.randn(len(lengths), heads, head_dim, generator=gen) * 3).to(dtype)
    return q, k_cache, v_cache, tables, torch.tensor(lengths, dtype=torch.int32)


def sdpa_error(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
               lengths: torch.Tensor, reference: torch.Tensor) -> float:
    """The error of torch's own SDPA in the same dtype: the yardstick for the kernel's."""
    bs = k_cache.shape[1]
    worst = 0.0
    for i, n in enumerate(lengths.tolist()):
        blocks = tables[i, : -(-n // bs)].long()
        keys, values = (c[blocks].flatten(0, 1)[:n].transpose(0, 1).unsqueeze(0) for c in (k_cache, v_cache))
        out = F.scaled_dot_product_attention(q[i].unsqueeze(0).unsqueeze(2), keys, values, enable_gqa=True)
        worst = max(worst, float((out[0, :, 0].double() - reference[i]).abs().max()))
    return worst


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"),
                         [(9, 3, 64, 16), (4, 4, 32, 32), (8, 2, 128, 16)], ids=["smollm2", "mha_d32", "gqa_d128"])
@pytest.mark.parametrize("chunk", [256, 7], ids=["chunk256", "chunk7"])
def test_kernel_equals_float64_attention(kernel: ModuleType, dtype: torch.dtype, heads: int, kv_heads: int,
                                         head_dim: int, block_size: int, chunk: int) -> None:
    # Lengths: the first token, a partial block, exactly one block, several chunks merged by log-sum-exp.
    gen = torch.Generator().manual_seed(head_dim + chunk)
    q, k_cache, v_cache, tables, lengths = random_pool(gen, lengths=[1, 5, block_size, 300, 613], heads=heads,
                                                       kv_heads=kv_heads, head_dim=head_dim,
                                                       block_size=block_size, dtype=dtype)
    out = native_decode.paged_decode(q, k_cache, v_cache, tables, lengths, module=kernel, chunk=chunk)
    reference = native_decode.reference_decode(q, k_cache, v_cache, tables, lengths)
    assert out.dtype == dtype and out.shape == q.shape
    error = float((out.double() - reference).abs().max())
    yardstick = sdpa_error(q, k_cache, v_cache, tables, lengths, reference)
    # fp32: ~1e-6 against SDPA's ~1e-6; bf16: the output's rounding, as SDPA's.
    assert error <= 2 * yardstick + 1e-5, f"kernel {error:.2e}, SDPA {yardstick:.2e}"


def test_one_sequence_alone_equals_it_in_a_batch(kernel: ModuleType) -> None:
    # A sequence's result does not depend on what else the step decodes (nor on the thread split).
    gen = torch.Generator().manual_seed(5)
    q, k_cache, v_cache, tables, lengths = random_pool(gen, lengths=[40, 700, 3], heads=9, kv_heads=3, head_dim=64,
                                                       block_size=16, dtype=torch.bfloat16)
    batch = native_decode.paged_decode(q, k_cache, v_cache, tables, lengths, module=kernel)
    alone = native_decode.paged_decode(q[1:2].contiguous(), k_cache, v_cache, tables[1:2].contiguous(), lengths[1:2],
                                       module=kernel)
    assert torch.equal(batch[1:2], alone)


def test_bad_tables_are_refused_not_read(kernel: ModuleType) -> None:
    gen = torch.Generator().manual_seed(6)
    q, k_cache, v_cache, tables, lengths = random_pool(gen, lengths=[20, 33], heads=9, kv_heads=3, head_dim=64,
                                                       block_size=16, dtype=torch.float32)
    beyond = lengths.clone()
    beyond[1] = tables.shape[1] * 16 + 1  # more keys than its table covers
    with pytest.raises(RuntimeError, match="outside its block table"):
        native_decode.paged_decode(q, k_cache, v_cache, tables, beyond, module=kernel)
    outside = tables.clone()
    outside[0, 0] = k_cache.shape[0]
    with pytest.raises(RuntimeError, match="outside the pool"):
        native_decode.paged_decode(q, k_cache, v_cache, outside, lengths, module=kernel)
    with pytest.raises(RuntimeError, match="one dtype"):
        native_decode.paged_decode(q, k_cache.bfloat16(), v_cache.bfloat16(), tables, lengths, module=kernel)


@pytest.mark.parametrize("max_new", [1, 5, native_decode.MAX_NEW])
@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)], ids=["fp32", "bf16"])
def test_the_backend_hands_it_the_short_spans_and_the_rest_to_torch(kernel: ModuleType, dtype: torch.dtype,
                                                                    atol: float, max_new: int) -> None:
    # The mixed step of test_backends (decodes, verifies, prompt chunks; scattered and contiguous tables):
    # spans of up to max_new tokens go to the kernel in one call, a row per token; the rest to torch.
    backend = PagedViewsBackend(kernel=kernel, kernel_max_new=max_new)
    step, q, k, v, k_cache, v_cache, reference = build_step(dtype, backend, head_dim=64)
    planned = backend.plan(step.meta, dtype=dtype)
    taken = [i for i, (num_new, _, _) in enumerate(SEQUENCES) if num_new <= max_new]
    assert planned.decode_group is not None and planned.decode_group.span_indices == frozenset(taken)
    assert planned.decode_group.token_index.shape[0] == sum(SEQUENCES[i][0] for i in taken)
    out = attend(q, k, v, k_cache, v_cache, StepAttention(meta=planned, backend=backend))
    torch.testing.assert_close(out.double(), reference, atol=atol, rtol=0)


def test_a_step_of_decodes_only_is_one_call(kernel: ModuleType) -> None:
    backend = PagedViewsBackend(kernel=kernel)
    gen = torch.Generator().manual_seed(7)
    q, k_cache, v_cache, tables, lengths = random_pool(gen, lengths=[9, 64, 130], heads=9, kv_heads=3, head_dim=64,
                                                       block_size=16, dtype=torch.bfloat16)
    from decodeservice.engine.attention import AttentionMetadata, SequenceSpan, slot_runs

    spans = tuple(SequenceSpan(token_start=i, num_new=1, context_len=int(n),
                               runs=slot_runs(tables[i].tolist(), num_tokens=int(n), block_size=16),
                               block_table=tables[i, : -(-int(n) // 16)].long()) for i, n in enumerate(lengths))
    last = [int(tables[i, (int(n) - 1) // 16]) * 16 + (int(n) - 1) % 16 for i, n in enumerate(lengths)]
    meta = backend.plan(AttentionMetadata(slot_mapping=torch.tensor(last), spans=spans, block_size=16),
                        dtype=torch.bfloat16)
    assert meta.decode_group is not None and meta.decode_group.covers_all_in_order
    k_new, v_new = (c.view(-1, 3, 64)[torch.tensor(last)] for c in (k_cache, v_cache))  # already in the pool
    out = backend.attend(q, k_new, v_new, k_cache, v_cache, meta)
    assert torch.equal(out, native_decode.paged_decode(q, k_cache, v_cache, tables, lengths, module=kernel))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32_q", "bf16_q"])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"),
                         [(9, 3, 64, 16), (4, 4, 32, 32), (8, 2, 128, 16)], ids=["smollm2", "mha_d32", "gqa_d128"])
def test_int8_pools_equal_float64_attention_over_their_values(kernel: ModuleType, dtype: torch.dtype, heads: int,
                                                              kv_heads: int, head_dim: int, block_size: int) -> None:
    gen = torch.Generator().manual_seed(head_dim + 11)
    q, k_cache, v_cache, tables, lengths = random_pool(gen, lengths=[1, 5, block_size, 300, 613], heads=heads,
                                                       kv_heads=kv_heads, head_dim=head_dim,
                                                       block_size=block_size, dtype=dtype)
    k_pool, v_pool = kv_int8.pack_rows(k_cache), kv_int8.pack_rows(v_cache)
    out = native_decode.paged_decode_int8(q, k_pool, v_pool, tables, lengths, module=kernel, chunk=7)
    dequantized = [kv_int8.unpack_rows(pool, torch.float64) for pool in (k_pool, v_pool)]
    reference = native_decode.reference_decode(q, *dequantized, tables, lengths)
    assert out.dtype == dtype and out.shape == q.shape
    error = float((out.double() - reference).abs().max())
    # fp32: the kernel's own arithmetic; bf16: the output's rounding (2^-9 of a value, here up to twice that).
    bound = 1e-5 if dtype == torch.float32 else 2 ** -8 * float(reference.abs().max())
    assert error <= bound, f"{error:.2e} > {bound:.2e}"


def test_int8_rows_round_each_row_by_its_own_range_and_carry_its_scale() -> None:
    rows = torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, -2.0, 0.5, 0.0], [1e-30, 0.0, -1e-30, 0.0]])
    codes, scales = kv_int8.quantize_rows(rows)
    assert codes.dtype == torch.int8 and scales.dtype == torch.float32 and scales.shape == (3,)
    assert codes[0].tolist() == [0, 0, 0, 0] and scales[0] == 0  # a row of zeros stays zeros
    assert codes[1].tolist() == [64, -127, 32, 0]  # the absmax maps to 127; 1 / (2 / 127) = 63.5 rounds to even
    packed = kv_int8.pack_rows(rows)
    assert packed.dtype == torch.int8 and packed.shape == (3, kv_int8.row_width(4))
    assert torch.equal(packed[:, :4], codes) and torch.equal(packed[:, 4:].contiguous().view(torch.float32)[:, 0], scales)
    assert torch.allclose(kv_int8.unpack_rows(packed, torch.float32), rows, rtol=1e-2, atol=0)


def test_int8_pools_of_the_wrong_shape_or_type_are_refused(kernel: ModuleType) -> None:
    gen = torch.Generator().manual_seed(8)
    q, k_cache, v_cache, tables, lengths = random_pool(gen, lengths=[20, 33], heads=9, kv_heads=3, head_dim=64,
                                                       block_size=16, dtype=torch.bfloat16)
    k_pool, v_pool = kv_int8.pack_rows(k_cache), kv_int8.pack_rows(v_cache)
    with pytest.raises(RuntimeError, match="D \\+ 4"):  # codes without their scales
        native_decode.paged_decode_int8(q, k_pool[..., :64].contiguous(), v_pool[..., :64].contiguous(), tables,
                                        lengths, module=kernel)
    with pytest.raises(RuntimeError, match="int8 pools"):
        native_decode.paged_decode_int8(q, k_pool.to(torch.bfloat16), v_pool.to(torch.bfloat16), tables, lengths,
                                        module=kernel)


def test_a_verify_is_its_positions_decodes_bit_for_bit(kernel: ModuleType) -> None:
    # A verify of 5 tokens over 70 keys: its rows are the decodes at lengths 66..70 of the same table, so
    # speculation's attention is exactly plain decoding's.
    gen = torch.Generator().manual_seed(8)
    q, k_cache, v_cache, tables, _ = random_pool(gen, lengths=[70] * 5, heads=9, kv_heads=3, head_dim=64,
                                                 block_size=16, dtype=torch.bfloat16)
    tables[:] = tables[0]
    from decodeservice.engine.attention import AttentionMetadata, SequenceSpan, slot_runs

    span = SequenceSpan(token_start=0, num_new=5, context_len=70,
                        runs=slot_runs(tables[0].tolist(), num_tokens=70, block_size=16),
                        block_table=tables[0, :5].long())
    slots = [int(tables[0, p // 16]) * 16 + p % 16 for p in range(65, 70)]
    backend = PagedViewsBackend(kernel=kernel)
    meta = backend.plan(AttentionMetadata(slot_mapping=torch.tensor(slots), spans=(span,), block_size=16),
                        dtype=torch.bfloat16)
    assert meta.decode_group is not None and meta.decode_group.context_lens.tolist() == [66, 67, 68, 69, 70]
    k_new, v_new = (c.view(-1, 3, 64)[torch.tensor(slots)] for c in (k_cache, v_cache))
    out = backend.attend(q, k_new, v_new, k_cache, v_cache, meta)
    lengths = torch.arange(66, 71, dtype=torch.int32)
    assert torch.equal(out, native_decode.paged_decode(q, k_cache, v_cache, tables, lengths, module=kernel))
