"""A mixed step's row split: as row slices where each kind of row is one run, as gathers otherwise, with the
same rows through the same path either way."""

from __future__ import annotations

import pytest
import torch

from decodeservice.engine.attention.metadata import SequenceSpan
from decodeservice.engine.quant.step_rows import StepRows
from decodeservice.engine.runner import _step_rows


def _span(start: int, count: int, *, prompt: bool) -> SequenceSpan:
    return SequenceSpan(token_start=start, num_new=count, context_len=start + count, runs=(),
                        block_table=torch.zeros(1, dtype=torch.long), prompt=prompt)


@pytest.mark.parametrize("layout", [
    [(0, 3, False), (3, 9, True)],  # decode rows, then a prompt chunk: the scheduler's order
    [(0, 9, True), (9, 3, False)],
    [(0, 2, False), (2, 6, True), (8, 1, False), (9, 3, True)],  # no runs: gathers
])
def test_the_split_sends_each_row_through_its_path(layout: list[tuple[int, int, bool]]) -> None:
    rows = _step_rows([_span(s, n, prompt=p) for s, n, p in layout], device=torch.device("cpu"), deterministic=False)
    prompt_ids = [i for s, n, p in layout if p for i in range(s, s + n)]
    assert rows.prompt_rows is not None and rows.prompt_rows.tolist() == prompt_ids
    runs = len(layout) == 2
    assert (rows.prompt_span is not None) == runs
    flat = torch.randn(12, 5)
    got = rows.run(flat, prompt=lambda x: x * 2, other=lambda x: x + 1, invariant=lambda x: x, out_features=5)
    want = torch.stack([flat[i] * 2 if i in prompt_ids else flat[i] + 1 for i in range(12)])
    assert torch.equal(got, want)
    gathered = StepRows(prompt_rows=rows.prompt_rows, other_rows=rows.other_rows)
    assert torch.equal(gathered.run(flat, prompt=lambda x: x * 2, other=lambda x: x + 1, invariant=lambda x: x,
                                    out_features=5), got)


def test_a_step_of_one_kind_has_no_split() -> None:
    cpu = torch.device("cpu")
    assert _step_rows([_span(0, 4, prompt=False)], device=cpu, deterministic=False) == StepRows()
    only_prompt = _step_rows([_span(0, 4, prompt=True)], device=cpu, deterministic=False)
    assert only_prompt.other_rows is None and only_prompt.prompt_span is None
