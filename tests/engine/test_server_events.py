"""The streamed chunk's bytes: the pre-serialized envelope gives exactly what serializing the whole chunk
gives, for any text."""

from __future__ import annotations

import pytest

from decodeservice.engine.server import openai_format as fmt
from decodeservice.engine.server.streaming import sse, text_event_encoder

TEXTS = ["", " Paris", 'quote " and \\ backslash', "new\nline\ttab", "é中文🙂", "\x00", "\ufffd", "\x00slot\x00"]


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("include_usage", [False, True])
def test_text_events_match_whole_serialization(kind: fmt.Kind, include_usage: bool) -> None:
    meta = fmt.ResponseMeta.new(request_id="chatcmpl-1", model='m"odel', kind=kind)

    def make(text: str) -> dict[str, object]:
        return fmt.chunk(meta, text=text, include_usage_field=include_usage)

    encode = text_event_encoder(make)
    for text in TEXTS:
        assert encode(text) == sse(make(text))


def test_a_template_holding_the_slot_twice_falls_back_to_whole_serialization() -> None:
    encode = text_event_encoder(lambda text: {"a": text, "b": text})
    assert encode("x") == sse({"a": "x", "b": "x"})
