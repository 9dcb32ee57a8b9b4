"""Verification of draft tokens: small pure tensor functions (after gpt-fast's `speculative_decode`).

Shapes: k = number of drafts, V = vocabulary. `p` holds the target's distribution at each of the k+1
positions it scored (row i is the distribution of the token after draft i-1; row k is the bonus
position); `q` holds the proposer's distribution for each draft (None: the drafts are deterministic,
q is one-hot on the draft, as for n-gram lookup).

Both rules return the accepted drafts plus exactly one more token, so 1..k+1 tokens.
"""

from __future__ import annotations

import torch


def greedy_accept(draft_ids: torch.Tensor, target_ids: torch.Tensor) -> list[int]:
    """Greedy rule: accept the longest prefix of drafts equal to the target's argmax, then add the
    target's own token at the first mismatch (or the bonus token when every draft matched).

    draft_ids: (k,), target_ids: (k+1,) argmax of each scored position."""
    k = draft_ids.shape[0]
    # cumprod turns the match mask into "still matching": 1 1 0 1 -> 1 1 0 0.
    num_accepted = int((draft_ids == target_ids[:k]).long().cumprod(0).sum())
    return [*draft_ids[:num_accepted].tolist(), int(target_ids[num_accepted])]


def accept_probabilities(p: torch.Tensor, q: torch.Tensor | None, draft_ids: torch.Tensor) -> torch.Tensor:
    """min(1, p(d) / q(d)) for each draft d. (k,)

    With one-hot q (q is None) this is simply p(d): a deterministic draft is kept with exactly the
    probability the target would have sampled it."""
    k = draft_ids.shape[0]
    index = torch.arange(k, device=p.device)
    p_draft = p[index, draft_ids]  # (k,)
    if q is None:
        return p_draft.clamp(max=1.0)
    q_draft = q[index, draft_ids]  # (k,) > 0: the proposer sampled d from q
    return (p_draft / q_draft.clamp_min(torch.finfo(q_draft.dtype).tiny)).clamp(max=1.0)


def residual_distribution(p_row: torch.Tensor, q_row: torch.Tensor | None, draft_id: int) -> torch.Tensor:
    """norm(max(p - q, 0)): where to resample after rejecting draft_id. (V,) -> (V,)

    This is the part of p that q under-covers; drawing from it after a rejection makes the combined
    outcome distributed exactly as p. With one-hot q it is p with the draft token removed."""
    if q_row is None:
        residual = p_row.clone()
        residual[draft_id] = 0.0
    else:
        residual = (p_row - q_row).clamp(min=0.0)
    total = residual.sum()
    if not bool(total > 0):
        # Only reachable through rounding when p == q (then rejection has probability 0 anyway).
        return p_row
    return residual / total


def rejection_sample(draft_ids: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None,
                     generator: torch.Generator | None) -> list[int]:
    """Lossless speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

    For i = 0..k-1: accept draft d_i with probability min(1, p_i(d_i) / q_i(d_i)); at the first
    rejection, resample from norm(max(p_i - q_i, 0)) and stop. If every draft is accepted, add a
    bonus token sampled from p_k. The output is distributed exactly as sampling p token by token.

    draft_ids: (k,), p: (k+1, V), q: (k, V) or None (one-hot)."""
    k = draft_ids.shape[0]
    # All k uniforms are drawn up front, so the generator advances the same way whatever is accepted.
    uniforms = torch.rand(k, generator=generator, device=p.device)
    accepted = uniforms < accept_probabilities(p, q, draft_ids)  # (k,)
    num_accepted = int(accepted.long().cumprod(0).sum())
    if num_accepted == k:
        final = p[k]  # bonus position
    else:
        final = residual_distribution(p[num_accepted], None if q is None else q[num_accepted],
                                      int(draft_ids[num_accepted]))
    token = int(torch.multinomial(final, 1, generator=generator))
    return [*draft_ids[:num_accepted].tolist(), token]


def sample_and_match(draft_ids: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None,
                     generator: torch.Generator | None) -> list[int]:
    """Deterministic mode's rule for temperature > 0: at each position draw the target's token from p_i
    with one torch.multinomial from the request's generator, as plain decoding draws each token, and go on
    while it equals the draft (else it is the corrected token; after k matches, the bonus).

    Lossless for any proposer: every token is a draw from p_i, the drafts only say how many positions one
    step settles. And the same draws in the same order: a seeded request gets plain decoding's tokens,
    speculation on or off. It keeps a draft with probability p(d), which for a sampling proposer is below
    rejection_sample's min(1, p(d) / q(d)); `q` is not read.

    draft_ids: (k,), p: (k+1, V)."""
    tokens: list[int] = []
    for i in range(draft_ids.shape[0] + 1):
        tokens.append(int(torch.multinomial(p[i], 1, generator=generator)))
        if i == draft_ids.shape[0] or tokens[-1] != int(draft_ids[i]):
            break
    return tokens
