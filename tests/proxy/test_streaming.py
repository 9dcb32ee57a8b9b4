"""The SSE meter's byte scan agrees with decoding each event's JSON."""

from __future__ import annotations

import json
from typing import Any

import pytest

from decodeservice.proxy.streaming import SseMeter

TOKEN_EVENTS: list[dict[str, Any]] = [
    {"choices": [{"index": 0, "text": " t0", "logprobs": None, "finish_reason": None}]},
    {"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]},
    {"choices": [{"index": 0, "delta": {"reasoning_content": "hmm"}}]},  # vLLM before 0.30
    {"choices": [{"index": 0, "delta": {"reasoning": "hmm"}}]},  # vLLM 0.30 on (tests/support/contracts/)
    {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]}}]},
    {"choices": [{"index": 0, "delta": {"content": "\"quoted\""}}]},
    {"choices": [{"index": 0, "text": "\\"}]},
]
NON_TOKEN_EVENTS: list[dict[str, Any]] = [
    {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
    {"choices": [{"index": 0, "delta": {"content": None}, "finish_reason": "stop"}]},
    {"choices": [{"index": 0, "delta": {"tool_calls": []}}]},
    {"choices": [{"index": 0, "delta": {"reasoning": None}}]},
    {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]},
    # Chat logprobs have a `content` key holding a list, not output text.
    {"choices": [{"index": 0, "delta": {}, "logprobs": {"content": [{"token": "a", "logprob": -1.0}]}}]},
    # A key name inside a string value is escaped, so it cannot be mistaken for a real key.
    {"choices": [{"index": 0, "delta": {"role": "assistant"}}], "note": "\"text\": \"x\""},
    {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 7, "total_tokens": 8}},
]


def _sse(event: dict[str, Any], *, compact: bool) -> bytes:
    separators = (",", ":") if compact else (", ", ": ")
    return b"data: " + json.dumps(event, separators=separators).encode() + b"\n\n"


@pytest.mark.parametrize("compact", [False, True])
@pytest.mark.parametrize("event", TOKEN_EVENTS)
def test_token_events_are_counted(event: dict[str, Any], compact: bool) -> None:
    meter = SseMeter()
    meter.feed(_sse(event, compact=compact), 1.0)
    assert meter.token_times == [1.0]


@pytest.mark.parametrize("compact", [False, True])
@pytest.mark.parametrize("event", NON_TOKEN_EVENTS)
def test_other_events_are_not(event: dict[str, Any], compact: bool) -> None:
    meter = SseMeter()
    meter.feed(_sse(event, compact=compact), 1.0)
    assert meter.token_times == []


def test_events_split_across_chunks_and_usage() -> None:
    stream = b"".join(_sse(e, compact=True) for e in TOKEN_EVENTS[:2]) + b"data: [DONE]\n\n"
    meter = SseMeter()
    for i in range(0, len(stream), 7):  # cut mid-line, mid-key and mid-value
        meter.feed(stream[i:i + 7], float(i))
    assert len(meter.token_times) == 2 and meter.output_tokens == 2
    meter.feed(_sse(NON_TOKEN_EVENTS[-1], compact=False), 99.0)
    assert meter.output_tokens == 7  # the upstream's usage wins over counted events


def test_two_events_in_one_chunk_are_two_tokens() -> None:
    meter = SseMeter()
    meter.feed(_sse(TOKEN_EVENTS[0], compact=True) + _sse(TOKEN_EVENTS[1], compact=True), 2.0)
    assert meter.token_times == [2.0, 2.0]


ERROR_EVENTS: list[dict[str, Any]] = [
    {"error": {"message": "boom", "type": "BadRequestError", "param": None, "code": 400}},  # vLLM >= 0.10, OpenAI
    {"object": "error", "message": "boom", "type": "BadRequestError", "param": None, "code": 400},  # vLLM < 0.10
]


@pytest.mark.parametrize("compact", [False, True])
@pytest.mark.parametrize("event", ERROR_EVENTS)
def test_an_engines_error_event_is_noticed(event: dict[str, Any], compact: bool) -> None:
    meter = SseMeter()
    meter.feed(_sse(event, compact=compact), 1.0)
    assert meter.error_event and meter.token_times == []


@pytest.mark.parametrize("event", [*TOKEN_EVENTS, *NON_TOKEN_EVENTS,
                                   {"choices": [{"index": 0, "delta": {"content": '{"error": 1}'}}]}])
def test_no_other_event_is_an_error(event: dict[str, Any]) -> None:
    meter = SseMeter()
    meter.feed(_sse(event, compact=True) + _sse(event, compact=False), 1.0)
    assert not meter.error_event
