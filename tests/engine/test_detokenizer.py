"""The windowed incremental detokenizer emits exactly the text a full decode gives."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from decodeservice.engine.detokenizer import IncrementalDetokenizer
from decodeservice.engine.loader.gguf_loader import read_gguf_tokenizer
from decodeservice.engine.loader.registry import resolve_model_path
from decodeservice.engine.sampling_params import SamplingParams
from decodeservice.engine.tokenizer import Tokenizer

TEXTS = [
    "Hello, world! This is a test.",
    "Café crème, naïve façade — “quotes” and emoji 🚀🎉 mixed in.",
    "日本語のテキストと中文字符 mixed with English.",
    "def f(x):\n    return x ** 2  # tabs\tand\nnewlines\n\n",
    "  leading spaces and trailing   ",
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return read_gguf_tokenizer(resolve_model_path("smollm2-135m"))


def stream(tokenizer: Tokenizer, token_ids: list[int], params: SamplingParams, *, step: int = 1) -> str:
    detok = IncrementalDetokenizer(tokenizer, params)
    pieces = []
    for end in range(step, len(token_ids) + step, step):
        new, _ = detok.update(token_ids[:end], finished=end >= len(token_ids))
        pieces.append(new)
    assert "".join(pieces) == detok.text
    return detok.text


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("step", [1, 3])
def test_streamed_text_equals_full_decode(tokenizer: Tokenizer, text: str, step: int) -> None:
    ids = tokenizer.encode(text)
    assert stream(tokenizer, ids, SamplingParams(), step=step) == tokenizer.decode(ids, skip_special_tokens=True)


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(min_value=0, max_value=49151), min_size=1, max_size=40))
def test_random_token_ids_stream_to_the_full_decode(tokenizer: Tokenizer, ids: list[int]) -> None:
    assert stream(tokenizer, ids, SamplingParams()) == tokenizer.decode(ids, skip_special_tokens=True)


def test_stop_string_cuts_the_stream(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("one two three four five")
    text = stream(tokenizer, ids, SamplingParams(stop=[" four"]))
    assert text == "one two three"


@settings(max_examples=150, deadline=None)
@given(ids=st.lists(st.integers(min_value=0, max_value=49151), min_size=2, max_size=40),
       span=st.tuples(st.floats(0, 1), st.integers(1, 6)), include=st.booleans(), step=st.sampled_from([1, 2]))
def test_stop_string_anywhere_cuts_at_its_first_occurrence(tokenizer: Tokenizer, ids: list[int],
                                                           span: tuple[float, int], include: bool,
                                                           step: int) -> None:
    # The stop string is a piece of the full decode, so it can begin in text already emitted tokens ago.
    full = tokenizer.decode(ids, skip_special_tokens=True)
    if not full:
        return
    start = int(span[0] * (len(full) - 1))
    stop = full[start : start + span[1]]
    cut = full.index(stop) + (len(stop) if include else 0)
    params = SamplingParams(stop=[stop], include_stop_str_in_output=include)
    assert stream(tokenizer, ids, params, step=step) == full[:cut]
