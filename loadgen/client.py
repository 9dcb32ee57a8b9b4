"""Streaming client for any OpenAI-compatible server: one request in, one `RequestRecord` out.

Every request streams (`stream: true`) and asks for a final usage chunk (`stream_options.include_usage`),
so the record has the true output-token count even when the server packs several tokens per chunk. It
sends `ignore_eos: true` and `temperature: 0` so output lengths are what the benchmark asked for (vLLM,
our engine and llama.cpp's server accept `ignore_eos`; servers that do not know it ignore it).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import httpx

from decodeservice.loadgen.errors import ServerError
from decodeservice.loadgen.metrics import RequestRecord


@dataclass(frozen=True, kw_only=True)
class BenchRequest:
    """One request to send: a chat (`messages`) or a plain completion (`prompt`)."""

    id: str
    max_tokens: int
    prompt: str | None = None
    messages: tuple[tuple[str, str], ...] | None = None  # (role, content) pairs

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("a request has exactly one of prompt and messages")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.messages is not None else "/v1/completions"

    def body(self, model: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model,
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.messages is not None:
            body["messages"] = [{"role": role, "content": content} for role, content in self.messages]
        else:
            body["prompt"] = self.prompt
        return body


def base_url(url: str) -> str:
    """`http://h:p`, `http://h:p/` and `http://h:p/v1` all name the same server."""
    url = url.rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    if not url.startswith(("http://", "https://")):
        raise ServerError(f"--url must start with http:// or https://, got {url!r}")
    return url


async def list_models(client: httpx.AsyncClient, url: str) -> list[str]:
    """GET /v1/models; a server that cannot be reached raises a `ServerError` with a readable message."""
    try:
        response = await client.get(f"{url}/v1/models")
    except httpx.HTTPError as exc:
        raise ServerError(f"cannot reach {url}: {type(exc).__name__}: {exc or 'no response'}") from exc
    if response.status_code != 200:
        raise ServerError(f"GET {url}/v1/models answered HTTP {response.status_code}: {response.text[:200]}")
    try:
        return [str(m["id"]) for m in response.json()["data"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise ServerError(f"GET {url}/v1/models did not return an OpenAI model list") from exc


def _content(chunk: dict[str, Any]) -> str:
    """The text a streamed chunk carries, for completions (`text`) and chat (`delta.content`)."""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        return str((choice.get("delta") or {}).get("content") or "")
    return str(choice.get("text") or "")


async def send(client: httpx.AsyncClient, *, url: str, model: str, request: BenchRequest) -> RequestRecord:
    """Send one streaming request and time every content chunk. Failures are recorded, not raised."""
    chunk_times: list[float] = []
    usage_tokens: int | None = None
    prompt_tokens: int | None = None
    error: str | None = None
    start = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}{request.path}", json=request.body(model)) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                error = f"HTTP {response.status_code}: {text[:200]}"
            else:
                async for line in response.aiter_lines():
                    now = time.perf_counter()
                    if not line.startswith("data:"):
                        continue  # blank separators, comments, `event:` lines
                    data = line[len("data:"):].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        error = f"stream error: {json.dumps(chunk['error'])[:200]}"
                        break
                    if _content(chunk):
                        chunk_times.append(now)
                    usage = chunk.get("usage")
                    if usage:
                        usage_tokens = usage.get("completion_tokens", usage_tokens)
                        prompt_tokens = usage.get("prompt_tokens", prompt_tokens)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    end = time.perf_counter()
    if error is None and not chunk_times:
        error = "the stream carried no content"
    return RequestRecord(
        start=start,
        end=end,
        chunk_times=tuple(chunk_times),
        output_tokens=usage_tokens if usage_tokens is not None else len(chunk_times),
        prompt_tokens=prompt_tokens,
        error=error,
    )
