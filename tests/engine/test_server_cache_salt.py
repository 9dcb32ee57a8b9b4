"""The prefix cache on the engine's OpenAI API: `cache_salt` is validated, and only requests with the
same salt share a cached prefix (read from the engine's prefix-cache hit counter on /metrics); each
response's `usage.prompt_tokens_details.cached_tokens` says how many prompt tokens were served from it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import ModelBundle
from tests.engine.test_server_harness import RunningServer, running_server

# Over 32 tokens: at least two full 16-token blocks can be served from the cache.
PROMPT = ("A cache salt keeps one tenant's prompts apart from another's: the same words under a "
          "different salt must be computed again, never read from the other tenant's blocks.")


@pytest.fixture(scope="module")
def srv(bundled: ModelBundle) -> Iterator[RunningServer]:
    with running_server(lambda: bundled.engine(kv_cache_gib=0.1, max_model_len=1024)) as running:
        yield running


def _hit_tokens(srv: RunningServer, path: str, body: dict[str, Any]) -> int:
    """Prompt tokens this one request was served from the prefix cache."""
    before = srv.sample("vllm:prefix_cache_hits_total")
    r = httpx.post(f"{srv.url}{path}", json={"max_tokens": 1, "temperature": 0, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return int(srv.sample("vllm:prefix_cache_hits_total") - before)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": PROMPT}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}]}),
])
def test_only_the_same_salt_hits(srv: RunningServer, path: str, body: dict[str, Any]) -> None:
    salt_a, salt_b = f"tenant-a{path}", f"tenant-b{path}"
    assert _hit_tokens(srv, path, {**body, "cache_salt": salt_a}) == 0  # first sight: nothing cached
    assert _hit_tokens(srv, path, {**body, "cache_salt": salt_b}) == 0  # another tenant: no hit
    assert _hit_tokens(srv, path, body) == 0  # no salt is a tenant of its own too
    assert _hit_tokens(srv, path, {**body, "cache_salt": salt_a}) >= 32  # the same tenant hits
    assert _hit_tokens(srv, path, body) >= 32


@pytest.mark.parametrize("salt, why", [
    (123, "string"), ("", "at least 1 character"), ("x" * 257, "at most 256 characters"), (["a"], "string"),
])
@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "Hi"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
])
def test_bad_salt_is_a_400(srv: RunningServer, path: str, body: dict[str, Any], salt: object, why: str) -> None:
    r = httpx.post(f"{srv.url}{path}", json={**body, "cache_salt": salt}, timeout=30)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "cache_salt" and error["type"] == "invalid_request_error"
    assert why in error["message"]


def _usage(srv: RunningServer, path: str, body: dict[str, Any], *, stream: bool) -> dict[str, Any]:
    """The usage block of one greedy request: the body's, or a stream's final usage chunk."""
    body = {"max_tokens": 2, "temperature": 0, **body}
    if not stream:
        r = httpx.post(f"{srv.url}{path}", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return dict(r.json()["usage"])
    chunks = []
    with httpx.stream("POST", f"{srv.url}{path}", json={**body, "stream": True,
                                                         "stream_options": {"include_usage": True}},
                      timeout=120) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks[-1]["choices"] == [] and all(c["usage"] is None for c in chunks[:-1])
    return dict(chunks[-1]["usage"])


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path, key", [("/v1/completions", "prompt"), ("/v1/chat/completions", "messages")])
def test_usage_reports_cached_prompt_tokens(srv: RunningServer, path: str, key: str, stream: bool) -> None:
    # A salt of its own, so no other test's blocks are cached for it (a chat's template begins the same).
    body: dict[str, Any] = {key: PROMPT if key == "prompt" else [{"role": "user", "content": PROMPT}],
                            "cache_salt": f"usage-{path}-{stream}"}
    first = _usage(srv, path, body, stream=stream)
    second = _usage(srv, path, body, stream=stream)
    assert first["prompt_tokens"] == second["prompt_tokens"] > 32
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    cached = second["prompt_tokens_details"]["cached_tokens"]
    # Whole 16-token blocks, never the last prompt token (it must be computed for the logits).
    assert cached >= 32 and cached % 16 == 0 and cached < second["prompt_tokens"]
    assert cached == 16 * ((second["prompt_tokens"] - 1) // 16)
