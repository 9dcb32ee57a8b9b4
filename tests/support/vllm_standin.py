"""A vLLM stand-in: a real loopback HTTP server that answers as one recorded vLLM release does.

It is built from a contract record (tests/support/contracts/vllm/<version>.json, written by
scripts/record_vllm_contract.py from that release's own source), not from what our code expects:

- it serves only routes the record lists as registered for a generative model with no optional flag
  (no `/ready`: a GET of a path vLLM lacks is FastAPI's 404 `{"detail":"Not Found"}`, a wrong method
  its 405);
- `GET /health` is 200 with an empty body, and once the engine is dead the record's status (503); while
  "loading" a real vLLM does not listen at all, so a test starts the stand-in late instead;
- errors are the record's ErrorResponse, `{"error": {...}}`; a stream that fails mid-way sends
  `data: <error JSON>` then `[DONE]`; with `api_key` set, the record's guarded prefixes answer 401
  `{"error": "Unauthorized"}` without `Authorization: Bearer <key>`;
- streams are compact JSON chunks (unset fields left out, completion chunks included): chat opens with
  a role-only chunk, a reasoning model's deltas carry the record's reasoning field, usage comes as a
  last `choices: []` chunk only when `stream_options.include_usage` asks (its default is the record's),
  `prompt_tokens_details` only when the server was started with --enable-prompt-tokens-details;
- a chat's output limit is `max_completion_tokens` whenever it is not null, else `max_tokens`;
- `/metrics` is prometheus_client's own ASGI app over every `vllm:` metric the record lists with no
  condition, labelled `model_name` and `engine` as there, with `_created` samples when the record says
  the release exposes them, plus the `http_` series an instrumented FastAPI server has.

It is test support, not product: nothing under `decodeservice` imports it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import time
from collections.abc import AsyncIterator, Iterable
from functools import cached_property
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_asgi_app
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Mount, Route

CONTRACTS = Path(__file__).resolve().parent / "contracts" / "vllm"
VERSIONS = tuple(sorted((p.stem for p in CONTRACTS.glob("*.json")), key=lambda v: tuple(map(int, v.split(".")))))
LATEST = VERSIONS[-1]
MODEL = "standin-model"
# The record's wire facts the stand-in acts out; a release whose record lacks one needs the stand-in reviewed.
ACTED_FACTS = frozenset({"sse_done", "chunk_json", "completion_chunk_compact", "chat_role_chunk",
                         "usage_only_when_asked", "usage_chunk", "prompt_tokens_details", "stream_error_event",
                         "max_tokens_precedence", "listens_once_loaded", "api_key_prefixes"})
# A route registered under this condition is served for a generative model (what the proxy fronts).
GENERATE = "'generate' in supported_tasks"
LOGGERS = "vllm/v1/metrics/loggers.py"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Contract:
    """One recorded vLLM release."""

    version: str
    data: dict[str, Any]

    @classmethod
    def load(cls, version: str = LATEST) -> Contract:
        path = CONTRACTS / f"{version}.json"
        data = json.loads(path.read_text(encoding="utf-8"))
        if data["vllm_version"] != version:
            raise ValueError(f"{path}: records vLLM {data['vllm_version']}, not {version}")
        return cls(version=version, data=data)

    @cached_property
    def routes(self) -> frozenset[tuple[str, str]]:
        """(method, path) of every route the release registers for a generative model, whatever its flags."""
        return frozenset((r["method"], r["path"]) for r in self.data["routes"] if r["condition"] in (None, GENERATE))

    @cached_property
    def nested_errors(self) -> bool:
        return "error" in self.data["schemas"]["ErrorResponse"]["fields"]

    def error_body(self, message: str, *, err_type: str = "BadRequestError", code: int = 400) -> dict[str, Any]:
        """vLLM's ErrorResponse, as `create_error_response` fills it."""
        info = {"message": message, "type": err_type, "param": None, "code": code}
        return {"error": info} if self.nested_errors else {"object": "error", **info}

    @cached_property
    def dead_status(self) -> int:
        caught = [a["status"] for a in self.data["health"]["answers"] if a["on_exception"]]
        return int(caught[0]) if caught else 500  # uncaught: FastAPI's plain-text 500

    @cached_property
    def metrics(self) -> tuple[dict[str, Any], ...]:
        """The `vllm:` metrics the engine always registers."""
        return tuple(m for m in self.data["metrics"] if m["file"] == LOGGERS and m["condition"] is None)

    def has_field(self, model: str, field: str) -> bool:
        return field in self.data["schemas"][model]["fields"]

    @cached_property
    def reasoning_field(self) -> str:
        """What a chat delta calls a reasoning model's thinking (`reasoning_content` before 0.30's rename)."""
        fields = self.data["schemas"]["DeltaMessage"]["fields"]
        return next(f for f in ("reasoning", "reasoning_content") if f in fields)

    @cached_property
    def include_usage_default(self) -> bool:
        return self.data["schemas"]["StreamOptions"]["fields"]["include_usage"].get("default") == "True"

    @cached_property
    def guarded_prefixes(self) -> tuple[str, ...]:
        return tuple(self.data["wire"]["api_key_prefixes"]["prefixes"])

    @cached_property
    def created_series(self) -> bool:
        return bool(self.data["created_series"]["exposed"])


def _dumps(event: dict[str, Any]) -> bytes:
    return json.dumps(event, separators=(",", ":"), ensure_ascii=False).encode()  # as model_dump_json


@dataclasses.dataclass(kw_only=True)
class VllmStandIn:
    """Knobs (tests change them between requests) and what the server saw."""

    contract: Contract = dataclasses.field(default_factory=Contract.load)
    url: str = ""  # set by whoever serves it
    model: str = MODEL
    max_model_len: int = 4096
    itl_s: float = 0.0
    dead: bool = False  # the engine core died: /health answers the record's failure status
    prompt_tokens_details: bool = False  # the server's --enable-prompt-tokens-details
    cached_tokens: int = 0  # the prefix-cache hit the next requests report
    fail_mid_stream_after: int | None = None  # tokens before an in-stream error event
    reasoning_tokens: int = 0  # a reasoning model: its first chat deltas carry thinking, not content
    api_key: str | None = None  # the server's --api-key
    kv_cache_usage: float = 0.0
    received: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    requests: list[tuple[str, str, int]] = dataclasses.field(default_factory=list)  # (method, path, status)
    running: int = 0

    def app(self) -> Starlette:
        routes: list[Route | Mount] = [
            Route("/health", self._health, methods=["GET"]),
            Route("/ping", self._health, methods=["GET", "POST"]),
            Route("/version", self._version, methods=["GET"]),
            Route("/v1/models", self._models, methods=["GET"]),
            Route("/tokenize", self._tokenize, methods=["POST"]),
            Route("/v1/completions", self._completions, methods=["POST"]),
            Route("/v1/chat/completions", self._chat, methods=["POST"]),
            _metrics_mount(self._metrics_app()),
        ]
        if missing := ACTED_FACTS - set(self.contract.data["wire"]):
            raise AssertionError(f"vLLM {self.contract.version}'s record does not state {sorted(missing)}")
        for method, path in self.served:
            if (method, path) not in self.contract.routes:
                raise AssertionError(f"vLLM {self.contract.version} has no {method} {path}; the stand-in must not")
        app = Starlette(routes=routes, exception_handlers={HTTPException: self._http_error})
        if self.api_key is not None:
            app.add_middleware(_ApiKey, key=self.api_key, prefixes=self.contract.guarded_prefixes)
        app.add_middleware(_Log, log=self.requests)
        return app

    @property
    def served(self) -> list[tuple[str, str]]:
        """(method, path) of every route this stand-in answers."""
        return [("GET", "/health"), ("GET", "/ping"), ("POST", "/ping"), ("GET", "/version"), ("GET", "/v1/models"),
                ("POST", "/tokenize"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                ("GET", "/metrics")]

    async def _http_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        detail = {404: "Not Found", 405: "Method Not Allowed"}.get(exc.status_code, exc.detail)
        return JSONResponse({"detail": detail}, status_code=exc.status_code)  # FastAPI's own handler

    def _error(self, message: str, *, code: int = 400, err_type: str = "BadRequestError") -> Response:
        return JSONResponse(self.contract.error_body(message, err_type=err_type, code=code), status_code=code)

    async def _health(self, request: Request) -> Response:
        if self.dead:
            status = self.contract.dead_status
            return PlainTextResponse("Internal Server Error", status_code=500) if status == 500 else Response(
                status_code=status)
        return Response(status_code=200)

    async def _version(self, request: Request) -> Response:
        return JSONResponse({"version": self.contract.version})

    async def _models(self, request: Request) -> Response:
        card = {"id": self.model, "object": "model", "created": int(time.time()), "owned_by": "vllm",
                "root": self.model, "parent": None, "max_model_len": self.max_model_len, "permission": []}
        return JSONResponse({"object": "list", "data": [card]})

    async def _json(self, request: Request) -> dict[str, Any] | Response:
        try:
            body = await request.json()
        except ValueError:
            return self._error("JSON decode error", err_type="Bad Request")
        if not isinstance(body, dict):
            return self._error("Input should be a valid dictionary", err_type="Bad Request")
        self.received.append(body)
        return body

    async def _tokenize(self, request: Request) -> Response:
        body = await self._json(request)
        if isinstance(body, Response):
            return body
        if isinstance(body.get("messages"), list):  # TokenizeChatRequest: the chat template's tokens too
            texts = [str(m.get("content", "")) for m in body["messages"] if isinstance(m, dict)]
            count = sum(len(t.split()) + 3 for t in texts) + (3 if body.get("add_generation_prompt", True) else 0)
            count += len(json.dumps(body.get("tools") or []).split()) if body.get("tools") else 0  # rendered too
        elif isinstance(body.get("prompt"), str):  # TokenizeCompletionRequest: BOS unless told otherwise
            count = len(body["prompt"].split()) + (1 if body.get("add_special_tokens", True) else 0)
        else:
            return self._error("1 validation error: prompt or messages required", err_type="Bad Request")
        return JSONResponse({"count": count, "max_model_len": self.max_model_len, "tokens": list(range(count)),
                             "token_strs": None})

    def _limit(self, body: dict[str, Any], *, chat: bool) -> int:
        # chat_completion/serving.py: max_completion_tokens whenever it is not null, else max_tokens; a
        # completion reads max_tokens alone (16 by default); chat's default is the context left
        mct = body.get("max_completion_tokens") if chat else None
        given = mct if mct is not None else body.get("max_tokens", None if chat else 16)
        return min(self.max_model_len, self.max_model_len if given is None else given)

    async def _completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def _chat(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, *, chat: bool) -> Response:
        body = await self._json(request)
        if isinstance(body, Response):
            return body
        if body.get("model") not in (None, self.model):
            return self._error(f"The model `{body['model']}` does not exist.", code=404, err_type="NotFoundError")
        n = self._limit(body, chat=chat)
        prompt = 5
        if body.get("stream"):
            options = body.get("stream_options")
            usage = isinstance(options, dict) and bool(options.get("include_usage", self.contract.include_usage_default))
            return StreamingResponse(self._stream(n, prompt, chat=chat, usage=usage), media_type="text/event-stream")
        text = "".join(f" t{i}" for i in range(self.reasoning_tokens if chat else 0, n))
        thought = "".join(f" r{i}" for i in range(min(n, self.reasoning_tokens))) or None
        choice: dict[str, Any] = (
            {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None, "annotations": None,
                                     "audio": None, "function_call": None, self.contract.reasoning_field: thought},
             "logprobs": None, "finish_reason": "length", "stop_reason": None} if chat
            else {"index": 0, "text": text, "logprobs": None, "finish_reason": "length", "stop_reason": None})
        return JSONResponse({"id": "chatcmpl-standin" if chat else "cmpl-standin",
                             "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                             "model": self.model, "choices": [choice], "usage": self._usage(prompt, n)})

    def _usage(self, prompt: int, completion: int) -> dict[str, Any]:
        usage: dict[str, Any] = {"prompt_tokens": prompt, "total_tokens": prompt + completion,
                                 "completion_tokens": completion}
        if self.prompt_tokens_details:  # the engine's count, 0 included
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        return usage

    async def _stream(self, n: int, prompt: int, *, chat: bool, usage: bool) -> AsyncIterator[bytes]:
        self.running += 1
        created = int(time.time())
        head: dict[str, Any] = ({"id": "chatcmpl-standin", "object": "chat.completion.chunk", "created": created,
                                 "model": self.model} if chat else
                                {"id": "cmpl-standin", "object": "text_completion", "created": created,
                                 "model": self.model})
        try:
            if chat:  # the role-only chunk (serving_chat.py), its content the empty string
                choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}
                yield b"data: " + _dumps({**head, "choices": [choice], "prompt_token_ids": None}) + b"\n\n"
            for i in range(n):
                await asyncio.sleep(self.itl_s)
                if self.fail_mid_stream_after is not None and i >= self.fail_mid_stream_after:
                    error = self.contract.error_body("engine step failed", err_type="BadRequestError", code=400)
                    yield b"data: " + _dumps(error) + b"\n\n"
                    break
                finish = "length" if i == n - 1 else None
                if chat:
                    delta = ({self.contract.reasoning_field: f" r{i}"} if i < self.reasoning_tokens
                             else {"content": f" t{i}"})
                    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
                    if finish is not None:
                        choice |= {"stop_reason": None, "token_ids": None}
                    chunk = {**head, "choices": [choice]}
                else:  # compact too: unset fields (usage above all) left out
                    choice = {"index": 0, "text": f" t{i}", "logprobs": None, "finish_reason": finish,
                              "stop_reason": None, "prompt_token_ids": None, "token_ids": None}
                    chunk = {**head, "choices": [choice]}
                yield b"data: " + _dumps(chunk) + b"\n\n"
            else:
                if usage:
                    yield b"data: " + _dumps({**head, "choices": [], "usage": self._usage(prompt, n)}) + b"\n\n"
            yield b"data: [DONE]\n\n"
        finally:
            self.running -= 1

    def _metrics_app(self) -> Any:
        """prometheus_client's ASGI app (vLLM mounts the same) over the record's metrics, read live."""
        registry = CollectorRegistry(auto_describe=True)
        standin = self
        values = {"vllm:num_requests_running": lambda: float(standin.running),
                  "vllm:num_requests_waiting": lambda: 0.0,
                  "vllm:kv_cache_usage_perc": lambda: standin.kv_cache_usage}
        for m in self.contract.metrics:
            labels = m["labels"] or []
            kind = {"gauge": Gauge, "counter": Counter, "histogram": Histogram}[m["type"]]
            metric = kind(m["name"], f"vLLM {self.contract.version} {m['name']}", labels, registry=registry)
            child = metric.labels(*[self.model if x == "model_name" else "0" if x == "engine" else "stop"
                                    for x in labels]) if labels else metric
            if m["name"] in values and isinstance(child, Gauge):
                child.set_function(values[m["name"]])
        # What else a vLLM /metrics carries: the instrumentator's http_ series (the relay must drop them).
        Counter("http_requests", "Total number of requests by method, status and handler.", ["handler"],
                registry=registry).labels("/v1/chat/completions").inc()
        if self.contract.created_series:
            return make_asgi_app(registry=registry)
        exposed = CollectorRegistry(auto_describe=False)
        exposed.register(_NoCreated(registry))  # the release calls prometheus_client.disable_created_metrics()
        return make_asgi_app(registry=exposed)


class _NoCreated(Collector):
    """The families of `registry` without their `_created` samples."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterable[Metric]:
        for family in self.registry.collect():
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family


def _metrics_mount(app: Any) -> Mount:
    mount = Mount("/metrics", app)
    mount.path_regex = re.compile("^/metrics(?P<path>.*)$")  # as vLLM's mount_metrics: no 307 to /metrics/
    return mount


class _ApiKey:
    """vLLM's AuthenticationMiddleware: the guarded prefixes need the key as a Bearer token."""

    def __init__(self, app: Any, *, key: str, prefixes: tuple[str, ...]) -> None:
        self.app = app
        self.key = key
        self.prefixes = prefixes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and scope["path"].startswith(self.prefixes):
            auth = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            scheme, _, token = auth.partition(" ")
            if scheme.lower() != "bearer" or token != self.key:
                await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _Log:
    """Records (method, path, status) of every request, 404s included."""

    def __init__(self, app: Any, *, log: list[tuple[str, str, int]]) -> None:
        self.app = app
        self.log = log

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def record(message: Any) -> None:
            if message["type"] == "http.response.start":
                self.log.append((scope["method"], scope["path"], message["status"]))
            await send(message)

        await self.app(scope, receive, record)
