"""Decode and verify over a long cached context as two GEMMs on the pool's rows (bf16/fp16, CPU).

A run of pool slots is a contiguous (n, Hkv * D) matrix. Laying the step's queries out block-diagonally,
row (j, t, g) holding query head j * G + g of token t in the D columns of K/V head j and zeros
elsewhere, one GEMM against those rows scores every head at once, and a second one against the value
rows returns every head's output (the diagonal blocks of it). The zeros triple the multiply-adds, but
these GEMMs are bound by reading K and V, not by arithmetic, and they read each key once for all heads
with no copy, no per-head call and no expanded K/V. The softmax then spans every run of the table, so
a fragmented table needs no log-sum-exp merge either.

Why not the CPU flash kernel here: with the 3 query rows a decode gives it per K/V head (G folded into
the query length), it is far from the memory bound in reduced precision, and these GEMMs overtook it
at long contexts in bf16 (in fp32 they were slower, so fp32 keeps the kernel). Where they overtake it
differs by machine, so an engine measures its own crossover at start-up (context_plan.py), and
MIN_CONTEXT is only the default of a backend built outside an engine. benchmarks/long_context.py times
the backends per layer (`attention_per_layer_call` in its JSON).

Precision: the scores leave the bf16 GEMM rounded to bf16 (the kernel accumulates in fp32), as SDPA's
math path does; the softmax runs in fp32 and the probabilities are rounded to bf16 for the second
GEMM. tests/engine/attention/test_backends.py bounds the error against a float64 reference.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence as Seq

import torch

from decodeservice.engine.attention.metadata import SequenceSpan, SlotRun
from decodeservice.engine.kv_cache import cdiv

MIN_CONTEXT = 1536  # keys: the crossover where no start-up measurement set one (see above)
# Query tokens (a decode is 1, a verify 1 + drafts): the GEMMs grow with H * Q rows while the kernel's
# rows fill up, so their lead shrinks with Q and was gone at 16 (benchmarks/long_context.py's A/B).
MAX_QUERY = 9
DTYPES = (torch.bfloat16, torch.float16)


def applies(span: SequenceSpan, dtype: torch.dtype, *, min_context: int = MIN_CONTEXT) -> bool:
    return dtype in DTYPES and span.num_new <= MAX_QUERY and span.context_len >= min_context


def attend_matmul(q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, runs: Seq[SlotRun], *,
                  block_size: int) -> torch.Tensor:
    """q (Q, H, D) for the last Q of the keys in `runs` (the new ones, already written), causal among
    themselves; k_flat/v_flat (num_slots, Hkv, D) -> (Q, H, D)."""
    t, h, d = q.shape
    hkv = k_flat.shape[1]
    g = h // hkv
    # oneDNN builds (JIT-compiles) a GEMM for every new shape, at a cost above a decode's GEMMs: were the
    # key count exact, every decode step would pay that for each GEMM, as a context grows by one key per
    # step. So the last run is read to the end of its last block, slots the sequence owns, and the padding masked:
    # its probabilities are exactly 0. (Stale slots hold finite values: the pool starts zeroed and
    # receives only K/V the model computed.)
    last = runs[-1]
    padded = min(cdiv(last.length, block_size) * block_size, k_flat.shape[0] - last.first_slot)
    spans = [(r.first_slot, r.length) for r in runs[:-1]] + [(last.first_slot, padded)]
    width = sum(n for _, n in spans)
    context = width - (padded - last.length)
    # Row (j, t, g) holds query head j * G + g of token t, scaled, in K/V head j's D columns.
    scaled = (q * d**-0.5).view(t, hkv, g, d).transpose(0, 1)  # (Hkv, Q, G, D)
    blocks = q.new_zeros(hkv, t * g, hkv, d)
    torch.diagonal(blocks, dim1=0, dim2=2).copy_(scaled.reshape(hkv, t * g, d).permute(1, 2, 0))
    rows = blocks.view(hkv * t * g, hkv * d)  # block-diagonal
    keys = [k_flat[first : first + n].view(n, hkv * d) for first, n in spans]  # (n, Hkv*D) views
    values = [v_flat[first : first + n].view(n, hkv * d) for first, n in spans]
    parts = [torch.mm(rows, k.T) for k in keys]  # (Hkv*Q*G, n) each
    scores = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)  # (Hkv*Q*G, width)
    # The padding nobody sees; from column L - Q on, new token i sees the new tokens up to itself.
    scores[:, context:].fill_(float("-inf"))
    if t > 1:
        scores.view(hkv, t, g, width)[..., context - t : context].masked_fill_(_after_self(t, q.device), float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.mm(probs[:, : spans[0][1]], values[0])  # (Hkv*Q*G, Hkv*D)
    start = spans[0][1]
    for (_, n), v in zip(spans[1:], values[1:], strict=True):
        out.addmm_(probs[:, start : start + n], v)
        start += n
    # Row (j, t, g) wants column block j: the diagonal over the two K/V-head axes.
    diagonal = torch.diagonal(out.view(hkv, t, g, hkv, d), dim1=0, dim2=3)  # (Q, G, D, Hkv)
    return diagonal.permute(0, 3, 1, 2).reshape(t, h, d)


@functools.cache
def _after_self(t: int, device: torch.device) -> torch.Tensor:
    """(1, Q, 1, Q) bool, True where new token i would see new token j > i: built once per Q."""
    return (torch.arange(t, device=device) > torch.arange(t, device=device).unsqueeze(1)).view(1, t, 1, t)
