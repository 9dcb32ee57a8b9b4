"""The OpenAI API on a real uvicorn, served by the bundled model (one server for the module)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from decodeservice.engine import SamplingParams
from tests.conftest import ModelBundle
from tests.engine.test_server_harness import MODEL, RunningServer, running_server, wait_until

ENGINE_CONFIG = {"kv_cache_gib": 0.25, "max_model_len": 2048}
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def srv(bundled: ModelBundle) -> Iterator[RunningServer]:
    with running_server(lambda: bundled.engine(**ENGINE_CONFIG)) as running:
        yield running


@pytest.fixture(scope="module")
def client(srv: RunningServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def reference(bundled: ModelBundle, prompt: str | list[int], max_tokens: int) -> str:
    """What the offline engine says for the same greedy request."""
    engine = bundled.engine(**ENGINE_CONFIG)
    return engine.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0))[0].text


def test_openai_client_completions_match_engine(srv: RunningServer, client: openai.OpenAI,
                                                bundled: ModelBundle) -> None:
    expected = reference(bundled, PROMPT, 8)
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    assert whole.choices[0].text == expected
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage is not None
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(bundled.tokenizer.encode(PROMPT)), 8)

    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 8


def test_openai_client_chat_matches_engine(srv: RunningServer, client: openai.OpenAI, bundled: ModelBundle) -> None:
    text = bundled.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    prompt_ids = bundled.tokenizer.encode(text, add_special_tokens=False)
    expected = reference(bundled, prompt_ids, 8)
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES,  # type: ignore[arg-type]
                                           max_completion_tokens=8, temperature=0)
    assert whole.choices[0].message.content == expected
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage is not None and whole.usage.prompt_tokens == len(prompt_ids)

    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8,  # type: ignore[arg-type]
                                            temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_seed_and_logprobs(srv: RunningServer, client: openai.OpenAI, bundled: ModelBundle) -> None:
    full = reference(bundled, PROMPT, 8)
    stop = full.split()[1]  # a word the greedy answer is known to reach
    stopped = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == full[: full.index(stop)]

    sampled = [client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=7)
               .choices[0].text for _ in range(2)]
    assert sampled[0] == sampled[1]

    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4,  # type: ignore[arg-type]
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 4
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0.0 for t in content)
    assert "".join(t.token for t in content) == chat.choices[0].message.content


def test_streamed_logprobs_are_the_whole_answers(client: openai.OpenAI) -> None:
    # The stream forwards each step's new logprobs; together they are the whole response's.
    args: dict[str, Any] = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 2}
    whole = client.completions.create(**args).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**args, stream=True) if c.choices]
    assert whole.logprobs is not None and whole.logprobs.tokens is not None and len(whole.logprobs.tokens) == 8
    streamed = [c.logprobs for c in chunks if c.logprobs is not None]
    assert [t for lp in streamed for t in lp.tokens or []] == whole.logprobs.tokens
    assert [o for lp in streamed for o in lp.text_offset or []] == whole.logprobs.text_offset
    assert [x for lp in streamed for x in lp.token_logprobs or []] == pytest.approx(whole.logprobs.token_logprobs)
    assert "".join(c.text for c in chunks) == whole.text == "".join(whole.logprobs.tokens)


async def test_sixteen_concurrent_streams(srv: RunningServer) -> None:
    before_ok = srv.sample("vllm:request_success_total", finished_reason="length")
    before_tokens = srv.sample("vllm:generation_tokens_total")
    before_ttft = srv.sample("vllm:time_to_first_token_seconds_count")
    peak = 0
    done = asyncio.Event()

    async def watch_running(http: httpx.AsyncClient) -> None:
        nonlocal peak
        while not done.is_set():
            text = (await http.get("/metrics")).text
            for line in text.splitlines():
                if line.startswith("vllm:num_requests_running{"):
                    peak = max(peak, int(float(line.rsplit(" ", 1)[1])))

    async def one(http: httpx.AsyncClient, i: int) -> str:
        body = {"model": MODEL, "prompt": f"Count to ten, attempt {i}:", "max_tokens": 4, "temperature": 0,
                "ignore_eos": True, "stream": True}
        text = ""
        async with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += json.loads(line[6:])["choices"][0]["text"]
        return text

    async with httpx.AsyncClient(base_url=srv.url, timeout=300) as http:
        watcher = asyncio.create_task(watch_running(http))
        texts = await asyncio.gather(*(one(http, i) for i in range(16)))
        done.set()
        await watcher
    assert len(texts) == 16 and all(texts)
    assert srv.sample("vllm:request_success_total", finished_reason="length") - before_ok == 16
    assert srv.sample("vllm:generation_tokens_total") - before_tokens == 16 * 4
    assert srv.sample("vllm:time_to_first_token_seconds_count") - before_ttft == 16
    assert peak > 1, "the running gauge never showed the concurrent requests"
    assert srv.sample("vllm:num_requests_running") == 0


def test_disconnect_aborts_and_frees_blocks(srv: RunningServer) -> None:
    aborted_before = srv.sample("vllm:request_success_total", finished_reason="abort")
    tokens_before = srv.sample("vllm:generation_tokens_total")
    body = {"model": MODEL, "prompt": "Tell me a very long story.", "max_tokens": 1000, "ignore_eos": True,
            "stream": True}
    with srv.client() as http, http.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["text"] is not None
        assert srv.aengine.stats().num_running == 1
    # The client has gone: the engine must drop the request and its KV blocks within a step or two.
    wait_until(lambda: srv.sample("vllm:num_requests_running") == 0, timeout=30, what="running gauge to be 0")
    stats = srv.aengine.stats()
    assert stats.num_free_blocks == stats.num_blocks
    assert srv.sample("vllm:request_success_total", finished_reason="abort") - aborted_before == 1
    assert srv.sample("vllm:generation_tokens_total") - tokens_before < 100


def test_non_streaming_disconnect_aborts(srv: RunningServer) -> None:
    aborted_before = srv.sample("vllm:request_success_total", finished_reason="abort")
    tokens_before = srv.sample("vllm:generation_tokens_total")
    body = {"model": MODEL, "prompt": "Tell me another long story.", "max_tokens": 1000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
        httpx.post(f"{srv.url}/v1/completions", json=body, timeout=httpx.Timeout(60, read=2.0))
    wait_until(lambda: srv.sample("vllm:request_success_total", finished_reason="abort") > aborted_before,
               timeout=30, what="the abandoned request to be aborted")
    wait_until(lambda: srv.sample("vllm:num_requests_running") == 0, timeout=30, what="running gauge to be 0")
    stats = srv.aengine.stats()
    assert stats.num_free_blocks == stats.num_blocks
    assert srv.sample("vllm:generation_tokens_total") - tokens_before < 200


BAD_INPUTS = [
    # (path, body, status, param, code)
    ("/v1/completions", b"{not json", 400, None, "invalid_json"),
    ("/v1/completions", b"[1, 2]", 400, None, "invalid_value"),
    ("/v1/completions", {"model": MODEL}, 400, "prompt", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, 400, "logprobs", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "n": 2}, 400, "n", "unsupported_parameter"),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, 400, "best_of", "unsupported_parameter"),
    ("/v1/completions", {"prompt": "x", "echo": True}, 400, "echo", "unsupported_parameter"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix", "unsupported_parameter"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt", "unsupported_parameter"),
    ("/v1/completions", {"prompt": [99999999]}, 400, "prompt", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options",
     "invalid_value"),
    ("/v1/completions", {"prompt": "hello " * 3000}, 400, "prompt", "context_length_exceeded"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model", "model_not_found"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", "invalid_value"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages.0.role",
     "invalid_value"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": [{"type": "function"}]}, 400, "tools",
     "unsupported_parameter"),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 2}, 400, "top_logprobs", "invalid_value"),
    ("/v1/chat/completions", {"messages": MESSAGES, "frobnicate": 1}, 400, "frobnicate", "unsupported_parameter"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": -3}, 400, "max_completion_tokens",
     "invalid_value"),
    ("/v1/completions", {"prompt": "x" * (2 << 20)}, 413, None, "request_too_large"),
    ("/tokenize", {"prompt": "x", "messages": MESSAGES}, 400, None, "invalid_value"),
    ("/v1/nowhere", {"prompt": "x"}, 404, None, "404"),
]


@pytest.mark.parametrize(("path", "body", "status", "param", "code"), BAD_INPUTS,
                         ids=[f"{i}-{case[0].rsplit('/', 1)[-1]}-{case[2]}" for i, case in enumerate(BAD_INPUTS)])
def test_bad_input_gets_openai_error(srv: RunningServer, path: str, body: bytes | dict[str, object], status: int,
                                     param: str | None, code: str) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(f"{srv.url}{path}", content=content, headers={"content-type": "application/json"},
                          timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["param"] == param and error["code"] == code
    assert error["type"] == "invalid_request_error"


def test_chunked_body_over_limit_gets_413(srv: RunningServer) -> None:
    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit must hold while reading
        yield b'{"prompt": "'
        for _ in range(40):
            yield b"x" * 65536
        yield b'"}'

    response = httpx.post(f"{srv.url}/v1/completions", content=chunks(), timeout=60)
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"


def test_models_tokenize_health_ready(srv: RunningServer, bundled: ModelBundle) -> None:
    with srv.client() as http:
        card = http.get("/v1/models").json()["data"][0]
        assert card["id"] == MODEL and card["kv_cache_dtype"] in ("bfloat16", "float32", "int8")
        assert card["kv_cache_dtype_reason"].startswith("auto: ")  # the default
        plan = card["plan"]  # the engine's execution plan, as `decodectl engine --explain-plan` prints it
        assert plan["device"] == "cpu" and plan["kv_cache"]["dtype"] == card["kv_cache_dtype"]
        assert plan["attention"]["backend"] == "paged_views" and plan["step"]["executor"] == "eager"
        assert http.get("/health").status_code == 200
        assert http.get("/ready").status_code == 200
        by_prompt = http.post("/tokenize", json={"prompt": PROMPT}).json()
        assert by_prompt["tokens"] == bundled.tokenizer.encode(PROMPT)
        assert by_prompt["count"] == len(by_prompt["tokens"]) and by_prompt["max_model_len"] == 2048
        by_chat = http.post("/tokenize", json={"messages": MESSAGES}).json()
        text = bundled.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
        assert by_chat["tokens"] == bundled.tokenizer.encode(text, add_special_tokens=False)


REQUIRED_METRICS = [
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
    "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:request_success_total", "vllm:num_preemptions_total",
    "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens",
]


def test_metrics_parse_with_vllm_names(srv: RunningServer, client: openai.OpenAI) -> None:
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0)  # histograms non-empty
    samples = srv.metrics()
    names = {name for name, _ in samples}
    families = {name.removesuffix("_total") for name in names} | {
        name.rsplit("_", 1)[0] for name in names if name.endswith(("_bucket", "_count", "_sum"))}
    for required in REQUIRED_METRICS:
        assert required in names or required in families, f"{required} missing from /metrics"
    assert all(dict(labels).get("model_name") == MODEL for _, labels in samples)
    assert samples[("vllm:e2e_request_latency_seconds_count", (("model_name", MODEL),))] >= 1
    assert samples[("vllm:prompt_tokens_total", (("model_name", MODEL),))] > 0
