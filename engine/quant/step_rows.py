"""What a step's rows are, for the projections: which are prompt rows, and whether every row takes one
path (deterministic mode). The runner builds one StepRows per step and hands it down the forward
(ForwardBatch.rows) to every projection; nothing holds it between steps."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# GEMM libraries pick their kernels by the number of rows, and a row's sums come out in another order
# under another kernel (fp32 MKL: a row of a 1-3, 5-7 or 9-11-row call differed from the same row in a
# longer one; oneDNN's packed fp32 at 1 row; AMD EPYC, AVX-512 and AVX2 dispatches alike). Prompt rows'
# dense calls are padded to a multiple of this many rows, so each row is computed as in any other such call.
ROW_TILE = 16


def tiled_linear(x: torch.Tensor, linear: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`linear` of (M, K) rows, called on them padded with zero rows to a multiple of ROW_TILE."""
    pad = -x.shape[0] % ROW_TILE
    if not pad:
        return linear(x)
    return linear(torch.cat([x, x.new_zeros(pad, x.shape[1])]))[: x.shape[0]]


@dataclass(frozen=True, kw_only=True)
class StepRows:
    """What one forward's rows are, built by the runner for its step and passed to every projection.

    `prompt_rows` / `other_rows`: where the step holds prompt rows (attention.SequenceSpan.prompt), their
    indices and the others'. A prompt row must compute the same function whatever the number of rows it
    came with: a prefix-cache hit leaves a short tail of the prompt where the miss ran it in one long
    chunk, so a path chosen by the call's row count (the weight-only kernel for a few rows, a dense GEMM
    for many) gave the hit other numbers than the miss. Prompt rows take one path (RowPlanned.prompt_path),
    and the step's other rows, split off, keep theirs."""

    prompt_rows: torch.Tensor | None = None  # (P,) row indices; None: the step holds no prompt row
    other_rows: torch.Tensor | None = None  # (N - P,); None: every row is a prompt row (or none is)
    # Where the prompt rows are one run of rows and the others the rest (one run too, before or after it),
    # the prompt rows' (start, stop): the split is then two row slices, views, not two gathers and two
    # scatters over every projection (the scheduler puts a step's decode rows before its prompt chunk, so a
    # mixed step's split is this one).
    prompt_span: tuple[int, int] | None = None
    # The engine's deterministic mode (EngineConfig.deterministic, the runner's from its construction): every
    # row of every call, prompt, decode, verify or head row, takes the module's row-invariant path.
    deterministic: bool = False

    def run(self, flat: torch.Tensor, *, prompt: Callable[[torch.Tensor], torch.Tensor],
            other: Callable[[torch.Tensor], torch.Tensor], invariant: Callable[[torch.Tensor], torch.Tensor],
            out_features: int) -> torch.Tensor:
        """(N, K) -> (N, out_features): prompt rows through `prompt`, the others through `other`; in
        deterministic mode every row through `invariant`."""
        if self.deterministic:
            return invariant(flat)
        if self.prompt_rows is None or flat.shape[0] != self.prompt_rows.shape[0] + (
                0 if self.other_rows is None else self.other_rows.shape[0]):
            return other(flat)  # no prompt row, or a call over other rows than the step's (the head)
        if self.other_rows is None:
            return prompt(flat)
        out = flat.new_empty(flat.shape[0], out_features)
        if self.prompt_span is not None:  # the same rows, in the same order
            p0, p1 = self.prompt_span
            o0, o1 = (p1, flat.shape[0]) if p0 == 0 else (0, p0)
            out[p0:p1] = prompt(flat[p0:p1])
            out[o0:o1] = other(flat[o0:o1])
            return out
        out[self.prompt_rows] = prompt(flat.index_select(0, self.prompt_rows))
        out[self.other_rows] = other(flat.index_select(0, self.other_rows))
        return out


# A forward with no prompt row and the default paths: a projection called outside a step (tests, the
# dense reference, the head of a default-mode step).
PLAIN_ROWS = StepRows()
