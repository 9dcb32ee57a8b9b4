"""vLLM's sampling fields over the API, on a real uvicorn serving the bundled model: the implemented ones
change the output exactly as the offline engine does with the same SamplingParams; the others are a
400 naming the field unless they hold their neutral value."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from decodeservice.engine import SamplingParams
from decodeservice.engine.server.protocol import STRUCTURED_OUTPUT_FIELDS
from tests.conftest import ModelBundle
from tests.engine.test_server_harness import MODEL, RunningServer, running_server

pytestmark = pytest.mark.model

ENGINE_CONFIG = {"kv_cache_gib": 0.25, "max_model_len": 2048}
SHORT_ANSWER = [{"role": "user", "content": "Reply with the single word: yes."}]
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def srv(bundled: ModelBundle) -> Iterator[RunningServer]:
    with running_server(lambda: bundled.engine(**ENGINE_CONFIG)) as running:
        yield running


def post(srv: RunningServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{srv.url}{path}", json={"model": MODEL, **body}, timeout=120)


def offline(bundled: ModelBundle, prompt: str | list[int], params: SamplingParams) -> list[int]:
    return bundled.engine(**ENGINE_CONFIG).generate([prompt], params)[0].token_ids


def chat_ids(bundled: ModelBundle, messages: list[dict[str, str]]) -> list[int]:
    text = bundled.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return bundled.tokenizer.encode(text, add_special_tokens=False)


def test_a_vllm_clients_defaults_are_accepted(srv: RunningServer) -> None:
    # What vLLM's own OpenAI-compatible clients send spelled out: every field at vLLM's default.
    body = {"messages": SHORT_ANSWER, "max_tokens": 4, "temperature": 0, "top_k": -1, "min_p": 0.0,
            "repetition_penalty": 1.0, "min_tokens": 0, "ignore_eos": False, "stop_token_ids": [],
            "skip_special_tokens": True, "spaces_between_special_tokens": True,
            "include_stop_str_in_output": False, "use_beam_search": False, "length_penalty": 1.0,
            "prompt_logprobs": None, "truncate_prompt_tokens": None, "add_generation_prompt": True,
            "add_special_tokens": False, "continue_final_message": False, "echo": False, "seed": 0,
            "presence_penalty": 0.0, "frequency_penalty": 0.0, "bad_words": [], "guided_json": None,
            "structured_outputs": None}
    response = post(srv, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text


def test_min_tokens_holds_eos_off(srv: RunningServer, bundled: ModelBundle) -> None:
    ids = chat_ids(bundled, SHORT_ANSWER)
    natural = offline(bundled, ids, SamplingParams(max_tokens=64, temperature=0.0))
    assert natural[-1] in bundled.tokenizer.eos_token_ids and len(natural) < 40  # it ends early on its own
    at_least = len(natural) + 8
    params = SamplingParams(max_tokens=64, temperature=0.0, min_tokens=at_least)
    expected = offline(bundled, ids, params)
    assert len(expected) >= at_least and expected[: len(natural) - 1] == natural[:-1]

    response = post(srv, "/v1/chat/completions", {"messages": SHORT_ANSWER, "max_tokens": 64, "temperature": 0,
                                                  "min_tokens": at_least})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == len(expected)
    assert response.json()["choices"][0]["message"]["content"] == bundled.tokenizer.decode(expected)


def test_stop_token_ids_end_the_answer(srv: RunningServer, bundled: ModelBundle) -> None:
    natural = offline(bundled, PROMPT, SamplingParams(max_tokens=8, temperature=0.0))
    stop_id = natural[3]
    first = natural.index(stop_id)
    response = post(srv, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                                             "stop_token_ids": [stop_id]})
    assert response.json()["usage"]["completion_tokens"] == first + 1
    assert response.json()["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("fields", [
    {"repetition_penalty": 1.8},
    {"presence_penalty": 1.5, "frequency_penalty": 1.0},
    {"temperature": 0.8, "seed": 11, "top_k": 20, "min_p": 0.05},
])
def test_penalties_and_min_p_match_the_offline_engine(srv: RunningServer, bundled: ModelBundle,
                                                      fields: dict[str, Any]) -> None:
    params = SamplingParams(max_tokens=24, temperature=fields.get("temperature", 0.0), ignore_eos=True,
                            **{k: v for k, v in fields.items() if k != "temperature"})
    expected = offline(bundled, PROMPT, params)
    response = post(srv, "/v1/completions", {"prompt": PROMPT, "max_tokens": 24, "ignore_eos": True,
                                             "temperature": 0, **fields})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == bundled.tokenizer.decode(expected)


def test_repetition_penalty_changes_a_repetitive_answer(bundled: ModelBundle) -> None:
    plain = offline(bundled, PROMPT, SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))
    penalized = offline(bundled, PROMPT, SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True,
                                                        repetition_penalty=1.8))
    assert penalized != plain
    assert len(set(penalized)) > len(set(plain))


def test_allowed_token_ids_and_truncation(srv: RunningServer, bundled: ModelBundle) -> None:
    allowed = bundled.tokenizer.encode(" Paris London", add_special_tokens=False)
    response = post(srv, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                                             "allowed_token_ids": allowed, "ignore_eos": True})
    text = response.json()["choices"][0]["text"]
    expected = offline(bundled, PROMPT, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                                       allowed_token_ids=tuple(allowed)))
    assert set(expected) <= set(allowed) and text == bundled.tokenizer.decode(expected)

    long_prompt = "one two three four five six seven eight nine ten " * 4
    response = post(srv, "/v1/completions", {"prompt": long_prompt, "max_tokens": 2, "truncate_prompt_tokens": 7})
    assert response.json()["usage"]["prompt_tokens"] == 7


NEUTRAL_ONLY = [
    ("spaces_between_special_tokens", False), ("use_beam_search", True), ("length_penalty", 0.5),
    ("prompt_logprobs", 1), ("bad_words", ["x"]), ("logits_processors", ["x"]),
    ("return_tokens_as_token_ids", True), ("return_token_ids", True), ("request_id", "mine"),
    ("kv_transfer_params", {"a": 1}), ("vllm_xargs", {"a": 1}), ("logit_bias", {"1": 2.0}),
    *[(name, {"type": "object"} if name == "structured_outputs" else ["a"] if name == "guided_choice" else "x")
      for name in STRUCTURED_OUTPUT_FIELDS],
]
CHAT_NEUTRAL_ONLY = [("continue_final_message", True), ("echo", True), ("chat_template", "{{ x }}"),
                     ("chat_template_kwargs", {"a": 1}), ("documents", [{"title": "t"}])]
BAD_VALUES = [("min_tokens", 99), ("min_tokens", -1), ("repetition_penalty", 0), ("min_p", 2.0), ("top_k", -2),
              ("presence_penalty", 3.0), ("stop_token_ids", [10**9]), ("allowed_token_ids", [10**9]),
              ("allowed_token_ids", []), ("truncate_prompt_tokens", 0)]


@pytest.mark.parametrize(("path", "field", "value", "code"), [
    *[("/v1/completions", f, v, "unsupported_parameter") for f, v in NEUTRAL_ONLY],
    *[("/v1/chat/completions", f, v, "unsupported_parameter") for f, v in CHAT_NEUTRAL_ONLY],
    *[("/v1/completions", f, v, "invalid_value") for f, v in BAD_VALUES],
], ids=lambda v: v if isinstance(v, str) else json.dumps(v)[:20])
def test_refused_fields_get_a_400_naming_them(srv: RunningServer, path: str, field: str, value: object,
                                              code: str) -> None:
    body: dict[str, Any] = {"prompt": PROMPT} if path == "/v1/completions" else {"messages": SHORT_ANSWER}
    response = post(srv, path, {**body, "max_tokens": 4, field: value})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and error["code"] == code and field in error["message"]
