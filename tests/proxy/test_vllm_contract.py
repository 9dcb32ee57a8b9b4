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


def test_records_name_their_release_source_and_license() -> None:
    assert set(VERSIONS) >= {"0.9.2", "0.11.0"}
    for version in VERSIONS:
        data = json.loads((CONTRACTS / f"{version}.json").read_text())
        assert data["vllm_version"] == version
        assert data["license"].startswith("Apache-2.0")
        assert data["recorded_from"].startswith(f"vllm-{version}-") and "sha256" in data["recorded_from"]
        assert data["recorded_by"] == "scripts/record_vllm_contract.py"
        for item in [*data["routes"], *data["metrics"], *data["wire"].values(), data["health"],
                     *data["schemas"].values()]:
            assert item["file"] in data["files"], item  # every fact names the file it came from


@pytest.mark.parametrize("version", VERSIONS)
def test_what_vllm_serves_and_what_it_does_not(version: str) -> None:
    contract = Contract.load(version)
    assert {("GET", "/health"), ("GET", "/v1/models"), ("POST", "/tokenize"), ("POST", "/v1/completions"),
            ("POST", "/v1/chat/completions"), ("GET", "/metrics"), ("GET", "/version"), ("GET", "/ping"),
            ("GET", "/load")} <= contract.routes
    assert not any(path == "/ready" for _, path in contract.routes)  # the fault of issue 25
    assert not any(r["path"] == "/ready" for r in contract.data["routes"])
    assert [a["status"] for a in contract.data["health"]["answers"] if a["on_exception"] is None] == [200]
    names = {m["name"] for m in contract.metrics}
    assert {"vllm:kv_cache_usage_perc", "vllm:num_requests_waiting", "vllm:num_requests_running"} <= names
    tokenize = contract.data["schemas"]["TokenizeResponse"]["fields"]
    assert tokenize["count"]["type"] == "int" and tokenize["count"]["required"]
    assert "prompt_tokens_details" in contract.data["schemas"]["UsageInfo"]["fields"]
    assert ACTED_FACTS <= set(contract.data["wire"])  # what the stand-in acts out, stated by this release


def test_releases_differ_where_the_record_says() -> None:
    old, new = Contract.load("0.9.2"), Contract.load("0.11.0")
    assert old.error_body("x") == {"object": "error", "message": "x", "type": "BadRequestError", "param": None,
                                   "code": 400}
    assert new.error_body("x") == {"error": {"message": "x", "type": "BadRequestError", "param": None, "code": 400}}
    assert (old.dead_status, new.dead_status) == (500, 503)
    old_metrics = {m["name"] for m in old.metrics}
    new_metrics = {m["name"] for m in new.metrics}
    assert "vllm:gpu_cache_usage_perc" in old_metrics - new_metrics  # hidden behind a flag from 0.10 on
    # 0.9.2 has no cache_salt on /v1/completions: an extra field it ignores (prefix isolation is chat-only there)
    assert not old.has_field("CompletionRequest", "cache_salt") and old.has_field("ChatCompletionRequest", "cache_salt")
    assert new.has_field("CompletionRequest", "cache_salt")


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


def test_the_recorder_reads_routes_health_and_metrics_from_source() -> None:
    rec = _recorder()
    api = textwrap.dedent('''
        @router.get("/health", response_class=Response)
        async def health(raw_request):
            try:
                await engine_client(raw_request).check_health()
                return Response(status_code=200)
            except EngineDeadError:
                return Response(status_code=503)

        @router.post("/ping")
        @router.get("/ping")
        async def ping(raw_request):
            return await health(raw_request)

        if envs.VLLM_SERVER_DEV_MODE:
            @router.post("/sleep")
            async def sleep(raw_request):
                return Response(status_code=200)

        def mount_metrics(app):
            app.routes.append(Mount("/metrics", make_asgi_app(registry=registry)))
    ''')
    routes = {(r["method"], r["path"]): r["condition"] for r in rec.routes(api)}
    assert routes == {("GET", "/health"): None, ("GET", "/ping"): None, ("POST", "/ping"): None,
                      ("POST", "/sleep"): "envs.VLLM_SERVER_DEV_MODE", ("GET", "/metrics"): None}
    assert rec.health(api)["answers"] == [{"status": 200, "body": "", "on_exception": None},
                                          {"status": 503, "body": "", "on_exception": "EngineDeadError"}]
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
           for m in rec.metrics(loggers, file="x.py", engine="v1")}
    assert got == {
        "vllm:num_requests_running": ("gauge", ["model_name", "engine"], ["vllm:num_requests_running"], None),
        "vllm:request_success": ("counter", ["model_name", "engine", "finished_reason"],
                                 ["vllm:request_success_total"], None),
        "vllm:old_seconds": ("histogram", [], ["vllm:old_seconds_bucket", "vllm:old_seconds_count",
                                               "vllm:old_seconds_sum"], "self.show_hidden_metrics"),
    }


def test_the_recorder_refuses_a_source_whose_wire_facts_changed(tmp_path: Path) -> None:
    rec = _recorder()
    chat = tmp_path / "vllm" / "entrypoints" / "openai" / "serving_chat.py"
    chat.parent.mkdir(parents=True)
    chat.write_text('yield "data: [DONE]\\n\\n"\n')  # nothing else of what the record states
    with pytest.raises(SystemExit, match="no longer matches"):
        rec.wire(rec.Source(root=tmp_path))


def test_latest_is_the_newest_record() -> None:
    assert LATEST == max(VERSIONS, key=lambda v: tuple(map(int, v.split("."))))
