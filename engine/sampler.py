"""Turning logits into tokens. Pure functions over one row at a time, so per-request seeds hold."""

from __future__ import annotations

import torch

from decodeservice.engine.outputs import TokenLogprob
from decodeservice.engine.sampling_params import SamplingParams


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    if params.greedy:
        return None
    generator = torch.Generator(device=device)
    if params.seed is not None:
        generator.manual_seed(params.seed)
    else:
        generator.seed()
    return generator


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution the request samples from: temperature, then top-k, then top-p. (.., V) -> (.., V)

    Greedy requests get a one-hot distribution on the argmax, which keeps speculative verification
    and plain sampling on one code path."""
    if params.greedy:
        return one_hot_probs(logits.argmax(dim=-1), logits.shape[-1])
    scaled = logits / params.temperature
    if params.top_k and params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # Keep the smallest set whose mass reaches top_p: drop a token once the mass before it does.
        drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def one_hot_probs(index: torch.Tensor, size: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(index, size).float()


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from one row of logits (V,)."""
    if params.greedy:
        return int(logits.argmax())
    probs = target_probs(logits, params)
    return int(torch.multinomial(probs, 1, generator=generator))


def token_logprob(logits: torch.Tensor, token_id: int, num_top: int) -> TokenLogprob:
    """Log-probability of the chosen token under the model's raw distribution, plus the top-n."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    top: dict[int, float] = {}
    if num_top:
        values, ids = torch.topk(logprobs, num_top)
        top = {int(i): float(v) for i, v in zip(ids, values, strict=True)}
    return TokenLogprob(token_id=token_id, logprob=float(logprobs[token_id]), top=top)
