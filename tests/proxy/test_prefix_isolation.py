"""admission.isolatePrefixCache: the proxy sets cache_salt from x-tenant (fake engine: what is sent;
real engine: tenant B never hits tenant A's prefix, tenant A does)."""

from __future__ import annotations

from typing import Any

import pytest

from decodeservice.proxy.policy import Policy
from decodeservice.proxy.prefix_isolation import NO_TENANT_SALT, tenant_salt
from tests.conftest import ModelBundle
from tests.engine.test_server_harness import running_server
from tests.proxy.conftest import running_proxy
from tests.support.fake_engine import FakeEngine

ISOLATED = {"admission": {"isolatePrefixCache": True}}
BODY = {"model": "m", "prompt": "a b", "max_tokens": 2}


def test_policy_field_defaults_off_and_parses() -> None:
    assert Policy().admission.isolate_prefix_cache is False
    assert Policy.from_yaml("admission: {isolatePrefixCache: true}").admission.isolate_prefix_cache is True


def test_salts_are_distinct_fixed_length_and_never_the_default() -> None:
    salts = {tenant_salt(t) for t in ["a", "b", "A", "", NO_TENANT_SALT, "x" * 10_000, "\u00e9"]}
    assert len(salts) == 7 and NO_TENANT_SALT not in salts
    assert {len(s) for s in salts} == {len("tenant-") + 64}
    assert tenant_salt(None) == NO_TENANT_SALT and tenant_salt("a") == tenant_salt("a")


async def test_isolation_sets_and_overwrites_the_salt(engine: FakeEngine) -> None:
    async with running_proxy(ISOLATED, engine.url) as (_, client):
        sent = [
            ({"x-tenant": "alice"}, BODY),
            ({"x-tenant": "bob"}, {**BODY, "cache_salt": tenant_salt("alice")}),  # claims alice's salt
            ({}, BODY),
            ({}, {**BODY, "cache_salt": "mine"}),
        ]
        for headers, body in sent:
            r = await client.post("/v1/completions", json=body, headers=headers)
            assert r.status_code == 200
        r = await client.post("/v1/chat/completions", headers={"x-tenant": "alice"},
                              json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 200
    assert [b["cache_salt"] for b in engine.received] == [
        tenant_salt("alice"), tenant_salt("bob"), NO_TENANT_SALT, NO_TENANT_SALT, tenant_salt("alice")]


async def test_without_isolation_the_body_passes_untouched(engine: FakeEngine) -> None:
    async with running_proxy({}, engine.url) as (_, client):
        assert (await client.post("/v1/completions", json=BODY, headers={"x-tenant": "a"})).status_code == 200
        assert (await client.post("/v1/completions", json={**BODY, "cache_salt": "c"})).status_code == 200
    assert "cache_salt" not in engine.received[0] and engine.received[1]["cache_salt"] == "c"


PROMPT = ("Tenants share one engine but never one cache entry: the same long prompt from another tenant "
          "is computed again rather than served from blocks that the first tenant filled, "
          "so neither can read nor time the other tenant's prompts by how quickly they come back.")


@pytest.mark.parametrize("isolate, b_hits", [(True, False), (False, True)])
async def test_tenants_do_not_share_prefixes_through_the_proxy(bundled: ModelBundle, isolate: bool,
                                                               b_hits: bool) -> None:
    with running_server(lambda: bundled.engine(kv_cache_gib=0.1, max_model_len=1024)) as srv:
        policy: dict[str, Any] = {"admission": {"isolatePrefixCache": isolate}}
        async with running_proxy(policy, srv.url) as (_, client):
            client.timeout = 120.0

            async def hits(tenant: str, salt: str | None = None) -> int:
                before = srv.aengine.stats().prefix_cache_hits
                body = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0}
                r = await client.post("/v1/completions", headers={"x-tenant": tenant},
                                      json=body if salt is None else {**body, "cache_salt": salt})
                assert r.status_code == 200, r.text
                return srv.aengine.stats().prefix_cache_hits - before

            assert await hits("a") == 0
            assert (await hits("b") > 0) is b_hits  # isolated: B cannot hit (nor time) A's prefix
            assert await hits("a") >= 32  # the same tenant still hits its own
            if isolate:  # B claiming A's salt gets it overwritten with its own, so it still cannot hit
                assert await hits("c", salt=tenant_salt("a")) == 0
