"""The proxy's /ready asks the path of its engine kind: /ready of the builtin engine, /health of vLLM.

The vLLM side runs against the stand-in built from vLLM's recorded contract (no /ready there), the
builtin side against the fake engine (which has one, as `decodectl engine` does).
"""

from __future__ import annotations

import argparse
import socket
from typing import Any

import pytest

from decodeservice.cli import proxy_cmd
from decodeservice.proxy.upstream_health import HEALTH_PATHS, EngineKind, UpstreamHealth
from tests.support.fake_engine import FakeEngine, serve_loopback
from tests.support.vllm_standin import VERSIONS, Contract, VllmStandIn


def test_the_path_follows_the_engine_kind_unless_overridden() -> None:
    assert UpstreamHealth.for_engine("builtin").path == "/ready"
    assert UpstreamHealth.for_engine(EngineKind.VLLM).path == "/health"
    assert UpstreamHealth.for_engine("vllm", path="/ping").path == "/ping"
    assert UpstreamHealth().path == HEALTH_PATHS[EngineKind.BUILTIN]
    with pytest.raises(ValueError, match="builtinn"):
        UpstreamHealth.for_engine("builtinn")


@pytest.mark.parametrize("path", ["health", "/he alth", "", "http://x/health", "/a#b"])
def test_a_bad_path_is_refused(path: str) -> None:
    with pytest.raises(ValueError, match="absolute path"):
        UpstreamHealth(path=path)


def test_the_cli_offers_exactly_the_engine_kinds() -> None:
    parser = argparse.ArgumentParser(exit_on_error=False)
    proxy_cmd.register(parser.add_subparsers())
    args = parser.parse_args(["proxy", "--upstream", "http://127.0.0.1:1"])
    assert args.engine_kind == EngineKind.BUILTIN.value and args.upstream_health_path is None
    for kind in EngineKind:  # the operator renders `--engine-kind vllm` for spec.engine.kind vllm
        assert parser.parse_args(["proxy", "--upstream", "u", "--engine-kind", kind.value]).engine_kind == kind
    with pytest.raises(SystemExit):
        parser.parse_args(["proxy", "--upstream", "u", "--engine-kind", "sglang"])


@pytest.mark.parametrize("version", VERSIONS)
async def test_builtin_readiness_in_front_of_vllm_never_becomes_ready(version: str, proxy: Any) -> None:
    """A fault once fixed: the old proxy asked every upstream for /ready, which vLLM answers 404."""
    standin = VllmStandIn(contract=Contract.load(version))
    async with serve_loopback(standin.app()) as url, proxy({}, url) as (_, client):
        response = await client.get("/ready")
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "upstream_not_ready"
    assert ("GET", "/ready", 404) in standin.requests


@pytest.mark.parametrize("version", VERSIONS)
async def test_vllm_readiness_follows_its_health(version: str, proxy: Any) -> None:
    standin = VllmStandIn(contract=Contract.load(version))
    health = UpstreamHealth.for_engine("vllm")
    async with serve_loopback(standin.app()) as url, proxy({}, url, upstream_health=health) as (_, client):
        ready = await client.get("/ready")
        assert (ready.status_code, ready.json()) == (200, {"status": "ready"})
        standin.dead = True  # the engine core died: /health is 503 (500 before 0.10)
        assert (await client.get("/ready")).status_code == 503
        standin.dead = False
        assert (await client.get("/ready")).status_code == 200
    assert all(path != "/ready" for _, path, _ in standin.requests)


async def test_vllm_still_loading_is_not_ready_until_it_listens(proxy: Any) -> None:
    # A loading vLLM has bound its port but does not accept yet: the proxy sees a refused connection.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    async with proxy({}, url, upstream_health=UpstreamHealth.for_engine("vllm")) as (_, client):
        assert (await client.get("/ready")).status_code == 503
        standin = VllmStandIn()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        async with serve_loopback(standin.app(), sock=sock):
            assert (await client.get("/ready")).status_code == 200


async def test_an_override_path_is_what_ready_asks(engine: FakeEngine, proxy: Any) -> None:
    engine.ready = False  # /ready would say no; /health says yes
    async with proxy({}, engine.url, upstream_health=UpstreamHealth(path="/health")) as (_, client):
        assert (await client.get("/ready")).status_code == 200
    async with proxy({}, engine.url) as (_, client):
        assert (await client.get("/ready")).status_code == 503
