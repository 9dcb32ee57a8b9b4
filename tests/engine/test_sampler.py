"""The sampler's logits processing (min_tokens, penalties, allowed ids, min_p), as pure functions."""

from __future__ import annotations

import pytest
import torch

from decodeservice.engine.errors import InvalidRequestError
from decodeservice.engine.sampler import process_logits, sample_token, target_probs
from decodeservice.engine.sampling_params import SamplingParams

EOS = 7


def process(logits: torch.Tensor, params: SamplingParams, *, prompt: tuple[int, ...] = (),
            output: tuple[int, ...] = ()) -> torch.Tensor:
    return process_logits(logits, params, prompt_token_ids=prompt, output_token_ids=output, eos_token_ids=(EOS,))


def test_min_tokens_keeps_eos_and_stop_ids_out_until_reached() -> None:
    logits = torch.zeros(10)
    logits[EOS] = 5.0
    params = SamplingParams(max_tokens=8, temperature=0.0, min_tokens=3, stop_token_ids=(2,))
    before = process(logits, params, output=(1, 1))
    assert before[EOS] == float("-inf") and before[2] == float("-inf")
    assert sample_token(before, params, None) not in (EOS, 2)
    after = process(logits, params, output=(1, 1, 1))
    assert torch.equal(after, logits) and sample_token(after, params, None) == EOS
    assert torch.equal(logits, torch.tensor([0.0] * EOS + [5.0, 0.0, 0.0]))  # the input is untouched


def test_min_tokens_with_ignore_eos_bans_only_the_stop_ids() -> None:
    params = SamplingParams(max_tokens=8, min_tokens=3, stop_token_ids=(2,), ignore_eos=True)
    out = process(torch.zeros(10), params)
    assert out[2] == float("-inf") and out[EOS] == 0.0


def test_min_tokens_never_leaves_nothing_to_sample() -> None:
    # allowed_token_ids holds only EOS: the contradiction resolves to the allowed ids, not NaN.
    params = SamplingParams(max_tokens=8, min_tokens=3, allowed_token_ids=(EOS,))
    out = process(torch.zeros(10), params)
    assert out[EOS] == 0.0 and torch.isfinite(out).sum() == 1


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    logits = torch.tensor([2.0, -2.0, 2.0, -2.0])
    out = process(logits, SamplingParams(repetition_penalty=2.0), prompt=(0,), output=(1,))
    assert out.tolist() == [1.0, -4.0, 2.0, -2.0]


def test_presence_and_frequency_penalties_count_the_output_only() -> None:
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = process(torch.zeros(4), params, prompt=(3, 3), output=(1, 1, 2))
    assert out.tolist() == [0.0, -1.0, -0.75, 0.0]


def test_allowed_token_ids_leave_only_those() -> None:
    logits = torch.arange(6, dtype=torch.float32)
    params = SamplingParams(temperature=0.0, allowed_token_ids=(1, 3))
    out = process(logits, params)
    assert torch.isfinite(out).nonzero().flatten().tolist() == [1, 3]
    assert sample_token(out, params, None) == 3


def test_bf16_rows_are_processed_in_fp32() -> None:
    out = process(torch.zeros(4, dtype=torch.bfloat16), SamplingParams(repetition_penalty=1.5), output=(1,))
    assert out.dtype == torch.float32


def test_min_p_drops_tokens_below_its_share_of_the_top() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    probs = target_probs(logits, SamplingParams(min_p=0.2))  # floor 0.1: the last one goes
    assert probs[3] == 0.0
    assert torch.allclose(probs[:3], torch.tensor([0.5, 0.3, 0.15]) / 0.95)
    generator = torch.Generator().manual_seed(0)
    draws = {sample_token(logits, SamplingParams(min_p=0.9), generator) for _ in range(50)}
    assert draws == {0}


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": float("nan")}, "repetition_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3.0}, "frequency_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"allowed_token_ids": ()}, "allowed_token_ids"),
    ({"stop_token_ids": (-1,)}, "stop_token_ids"),
])
def test_bad_values_name_their_field(kwargs: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert info.value.param == param


def test_token_ids_past_the_vocabulary_are_refused() -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(allowed_token_ids=(3, 10)).check_vocab(10)
    assert info.value.param == "allowed_token_ids"
    SamplingParams(stop_token_ids=(9,)).check_vocab(10)


def test_only_history_dependent_options_process_logits() -> None:
    assert not SamplingParams(top_k=5, min_p=0.1, top_p=0.9).processes_logits
    assert SamplingParams(min_tokens=1).processes_logits
    assert SamplingParams(repetition_penalty=1.1).processes_logits
    assert SamplingParams(allowed_token_ids=(1,)).processes_logits
