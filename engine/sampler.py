"""Turning logits into tokens. Pure functions over one row at a time, so per-request seeds hold.

The order, as vLLM's: `process_logits` (allowed ids, min_tokens, repetition, frequency and presence
penalties) on the raw row, then `target_probs` (temperature, top-k, min_p, top-p); logprobs report the
raw row, as vLLM's do by default.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

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


def process_logits(logits: torch.Tensor, params: SamplingParams, *, prompt_token_ids: Seq[int],
                   output_token_ids: Seq[int], eos_token_ids: Seq[int]) -> torch.Tensor:
    """One row of logits (V,) as this request's history changes it; a new tensor, the input untouched."""
    out = logits.float()  # a copy for bf16 rows; fp32 rows are cloned below before any write
    if out is logits:
        out = logits.clone()
    vocab = out.shape[-1]
    if params.allowed_token_ids is not None:
        allowed = torch.tensor(params.allowed_token_ids, dtype=torch.long)
        keep = out[allowed]
        out.fill_(float("-inf"))
        out[allowed] = keep
    if len(output_token_ids) < params.min_tokens:
        banned = [t for t in (*params.stop_token_ids, *(() if params.ignore_eos else eos_token_ids)) if t < vocab]
        if banned:
            index = torch.tensor(banned, dtype=torch.long)
            kept = out[index]
            out[index] = float("-inf")
            if not torch.isfinite(out).any():  # allowed_token_ids held only these: nothing left to sample
                out[index] = kept
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted({*prompt_token_ids, *output_token_ids}), dtype=torch.long)
        values = out[seen]
        out[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    if (params.presence_penalty or params.frequency_penalty) and output_token_ids:
        counts = torch.bincount(torch.tensor(list(output_token_ids), dtype=torch.long), minlength=vocab)[:vocab]
        out -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    return out


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution the request samples from: temperature, then top-k, min_p, top-p. (.., V) -> (.., V)

    Greedy requests get a one-hot distribution on the argmax, which keeps speculative verification
    and plain sampling on one code path."""
    if params.greedy:
        return one_hot_probs(logits.argmax(dim=-1), logits.shape[-1])
    scaled = logits / params.temperature
    if params.top_k and params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.min_p > 0.0:
        floor = params.min_p * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < floor, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
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
