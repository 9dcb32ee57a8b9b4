"""argmax_rows: the block-wise argmax the runner takes greedy picks from must be torch's argmax exactly."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from decodeservice.engine.sampler import ARGMAX_BLOCK, argmax_rows

SPECIALS = [float("nan"), float("inf"), float("-inf"), 0.0, 7.5]


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(1, 5), width=st.sampled_from([1, 7, ARGMAX_BLOCK, ARGMAX_BLOCK + 1, 3 * ARGMAX_BLOCK - 5,
                                                      4 * ARGMAX_BLOCK]),
       seed=st.integers(0, 2**31 - 1), levels=st.integers(1, 6),
       specials=st.lists(st.tuples(st.integers(0, 4), st.floats(0, 1), st.sampled_from(SPECIALS)), max_size=6),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_argmax_rows_is_torchs_argmax(rows: int, width: int, seed: int, levels: int,
                                      specials: list[tuple[int, float, float]], dtype: torch.dtype) -> None:
    # Few distinct values make ties within and across blocks common; specials put NaN, infinities and
    # repeated maxima at chosen places, the last column included.
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, levels, (rows, width), generator=gen).to(dtype)
    for row, where, value in specials:
        logits[row % rows, min(int(where * width), width - 1)] = value
    assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))


def test_argmax_rows_on_model_sized_rows() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(32, 49152, generator=gen)
    logits[3, -1] = 100.0  # the last logit, in the last block
    logits[4, 5000] = logits[4, 9000] = 100.0  # a tie across blocks: the first wins
    assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))
    assert argmax_rows(logits[:0]).shape == (0,)  # a step whose sequences all are mid-prompt
