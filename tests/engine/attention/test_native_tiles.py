"""attention/native_decode.py's tiles: consecutive rows of one sequence computed together give each row
bit for bit what it gets alone (so a prompt row, a verify row and a decode at that position agree)."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import pytest
import torch

from decodeservice.engine.attention import kv_int8, native_decode


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def prompt_rows(gen: torch.Generator, *, first_len: int, rows: int, heads: int, kv_heads: int, head_dim: int,
                pool: str) -> tuple[torch.Tensor, ...]:
    """A prompt chunk's kernel rows (lengths first_len .. first_len + rows - 1 over one scattered table),
    then a decode of another sequence, whose row must not join the tile."""
    block = 16
    width = -(-(first_len + rows) // block)
    num_blocks = 2 * width + 4
    k, v = (torch.randn(num_blocks, block, kv_heads, head_dim, generator=gen) * 3 for _ in range(2))
    order = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    tables = order[:width].repeat(rows + 1, 1)
    tables[rows] = order[width : 2 * width]
    lengths = torch.cat([torch.arange(first_len, first_len + rows), torch.tensor([first_len + rows])]).to(torch.int32)
    q = torch.randn(rows + 1, heads, head_dim, generator=gen) * 3
    if pool == "int8":
        return q.bfloat16(), kv_int8.pack_rows(k), kv_int8.pack_rows(v), tables.contiguous(), lengths
    dtype = torch.float32 if pool == "fp32" else torch.bfloat16
    return q.to(dtype), k.to(dtype), v.to(dtype), tables.contiguous(), lengths


@pytest.mark.parametrize("pool", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 32), (8, 2, 128), (6, 1, 64)],
                         ids=["gqa3_d64", "mha_d32", "gqa4_d128", "mqa_d64"])
def test_a_tile_gives_each_row_what_it_gets_alone(kernel: ModuleType, threads: int, pool: str, heads: int,
                                                  kv_heads: int, head_dim: int) -> None:
    attend = native_decode.paged_decode_int8 if pool == "int8" else native_decode.paged_decode
    gen = torch.Generator().manual_seed(head_dim * 7 + heads + threads)
    for _ in range(2):  # random lengths and tile offsets: pieces, blocks and tiles cut rows anywhere
        first_len = int(torch.randint(1, 400, (1,), generator=gen))
        rows = int(torch.randint(2, 2 * native_decode.TILE_ROWS, (1,), generator=gen))
        q, k, v, tables, lengths = prompt_rows(gen, first_len=first_len, rows=rows, heads=heads, kv_heads=kv_heads,
                                               head_dim=head_dim, pool=pool)
        together = attend(q, k, v, tables, lengths, module=kernel)
        for i in range(rows + 1):
            alone = attend(q[i : i + 1].contiguous(), k, v, tables[i : i + 1].contiguous(), lengths[i : i + 1],
                           module=kernel)
            assert torch.equal(together[i : i + 1], alone), f"row {i} of {rows} from length {first_len}"
        # The same rows with tiles of other sizes (a row at a time included), and offset by one row.
        for tile_rows in (1, 3, 64):
            assert torch.equal(attend(q, k, v, tables, lengths, module=kernel, tile_rows=tile_rows), together)
        assert torch.equal(attend(q[1:].contiguous(), k, v, tables[1:].contiguous(), lengths[1:], module=kernel),
                           together[1:])


def test_a_tile_matches_float64_attention(kernel: ModuleType) -> None:
    gen = torch.Generator().manual_seed(3)
    q, k, v, tables, lengths = prompt_rows(gen, first_len=100, rows=40, heads=9, kv_heads=3, head_dim=64, pool="fp32")
    out = native_decode.paged_decode(q, k, v, tables, lengths, module=kernel)
    reference = native_decode.reference_decode(q, k, v, tables, lengths)
    assert float((out.double() - reference).abs().max()) < 1e-4
