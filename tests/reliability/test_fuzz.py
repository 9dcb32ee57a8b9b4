"""Bad input, by property-based fuzzing: both HTTP APIs, the policy file, the CRD spec (the operator's
validation and `decodectl render`) and GGUF headers. No 5xx, no crash, no hang; every error in the
documented format. The number of cases is bounded here (RELIABILITY_FUZZ_EXAMPLES scales it, as
`benchmarks/reliability.py` does for the long runs) and every case is counted."""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from decodeservice.cli.main import main as decodectl
from decodeservice.engine.errors import ConfigError, ModelLoadError
from decodeservice.engine.loader import load_model
from decodeservice.operator.errors import InvalidSpecError
from decodeservice.operator.spec import validate_spec
from decodeservice.proxy.errors import PolicyError
from decodeservice.proxy.policy import Policy
from tests.conftest import ModelBundle
from tests.engine.test_loader import write_tiny_gguf
from tests.engine.test_server_harness import RunningServer, running_server
from tests.proxy.conftest import running_proxy
from tests.reliability.outcomes import Outcome, Seen, Tally, classify_body, classify_events
from tests.support.fake_engine import FakeEngine, serve_loopback

Record = Callable[[Tally], dict[str, Any]]
SCALE = float(os.environ.get("RELIABILITY_FUZZ_EXAMPLES_SCALE", "1"))
EXAMPLES_DIR = Path(__file__).parents[2] / "examples"


def examples(n: int) -> int:
    return max(1, int(n * SCALE))


def fuzz_settings(n: int) -> settings:
    # CI (scale 1) replays the same derandomized cases on every run, so a red CI is a regression, not a
    # new draw; `benchmarks/reliability.py fuzz --scale S` draws fresh random cases to find new faults.
    return settings(max_examples=examples(n), deadline=None, derandomize=SCALE == 1, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])


# -- strategies ------------------------------------------------------------------------------------
HUGE = st.integers(min_value=-(2**70), max_value=2**70)
SCALARS = st.none() | st.booleans() | HUGE | st.integers(-3, 70) | st.floats() | st.text(max_size=12)
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                          max_size=3), max_leaves=8)
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", ""]) | JSON,
                                           "content": st.text(max_size=40) | JSON}), max_size=3) | JSON
FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "model": st.sampled_from(["smollm2-135m", "m", ""]) | JSON,
    "prompt": st.text(max_size=60) | st.lists(st.integers(-5, 60000), max_size=8) | JSON,
    "messages": MESSAGES,
    "max_tokens": st.integers(-2, 8) | HUGE | JSON,
    "max_completion_tokens": st.integers(-2, 8) | JSON,
    "temperature": st.floats(-1, 3) | JSON, "top_p": st.floats(-1, 2) | JSON, "top_k": HUGE | JSON,
    "seed": HUGE | JSON, "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=5) | JSON,
    "stream": st.booleans() | JSON, "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | JSON,
    "n": st.integers(0, 3) | JSON, "logprobs": st.booleans() | st.integers(-1, 25) | JSON,
    "top_logprobs": st.integers(-1, 25) | JSON, "ignore_eos": st.booleans() | JSON, "priority": HUGE | JSON,
    "cache_salt": st.text(max_size=300) | JSON, "echo": JSON, "tools": JSON, "response_format": JSON,
    "logit_bias": JSON, "user": JSON,
}
# Plausible values: a valid request with these mixed in often passes validation and runs.
PLAUSIBLE: dict[str, st.SearchStrategy[Any]] = {
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(0, 60), "seed": HUGE,
    "stop": st.text(min_size=1, max_size=3), "stream": st.booleans(), "ignore_eos": st.booleans(),
    "stream_options": st.just({"include_usage": True}), "priority": HUGE, "cache_salt": st.text(max_size=300),
    "logprobs": st.integers(0, 20), "max_tokens": st.integers(1, 4),
}
VALID = {"/v1/completions": st.fixed_dictionaries({"prompt": st.text(min_size=1, max_size=40)}),
         "/v1/chat/completions": st.fixed_dictionaries({"messages": st.just([{"role": "user", "content": "Hi"}])})}
PATHS = st.sampled_from(sorted(VALID))
# OpenAI-shaped bodies with wild values (they reach deep into validation), near-valid ones (they run),
# and anything at all.
BODIES = st.fixed_dictionaries({}, optional=FIELDS) | st.dictionaries(st.text(max_size=12), JSON, max_size=4) | JSON
CASES = st.tuples(PATHS, BODIES) | PATHS.flatmap(lambda path: st.tuples(st.just(path), st.builds(
    lambda base, extra: {"max_tokens": 2, **base, **extra}, VALID[path], st.fixed_dictionaries({}, optional=PLAUSIBLE))))


def _post(client: httpx.Client, path: str, payload: bytes, headers: dict[str, str]) -> Seen:
    with client.stream("POST", path, content=payload, headers={"content-type": "application/json", **headers}) as r:
        raw = r.read()
    if r.status_code == 200 and r.headers.get("content-type", "").startswith("text/event-stream"):
        events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
        return classify_events(200, events)
    return classify_body(r.status_code, raw)


def _check(seen: Seen) -> None:
    assert seen.status < 500, f"a {seen.status}: {seen.detail}"
    assert seen.outcome is not Outcome.LOST, seen.detail


# -- the HTTP APIs ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_engine(bundled: ModelBundle) -> Iterator[RunningServer]:
    # A 48-token context bounds the work any valid fuzzed request can ask for.
    with running_server(lambda: bundled.engine(kv_cache_gib=0.02, max_model_len=48, max_num_seqs=4)) as srv:
        yield srv


def _payload(body: Any, raw_bytes: bytes | None) -> bytes:
    return raw_bytes if raw_bytes is not None else json.dumps(body).encode("utf-8", "surrogatepass")


RAW = st.none() | st.none() | st.none() | st.binary(max_size=40)  # sometimes not JSON at all


def test_fuzz_engine_http_api(small_engine: RunningServer, record: Record) -> None:
    tally = Tally("fuzz_engine_http")
    with httpx.Client(base_url=small_engine.url, timeout=60) as client:
        @fuzz_settings(120)
        @given(case_=CASES, raw=RAW)
        @example(case_=("/v1/completions", {"prompt": "x", "max_tokens": 1, "seed": 2**64}), raw=None)
        @example(case_=("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1,
                                                 "seed": -(2**63) - 1, "priority": 2**80}), raw=None)
        @example(case_=("/v1/completions", {"prompt": "x", "max_tokens": 2, "temperature": 5e-324}), raw=None)
        def case(case_: tuple[str, Any], raw: bytes | None) -> None:
            path, body = case_
            seen = _post(client, path, _payload(body, raw), {})
            tally.add(seen)
            _check(seen)

        case()
    assert record(tally)["lost"] == 0
    assert small_engine.aengine.stats().num_running == 0


async def test_fuzz_proxy_http_api(record: Record) -> None:
    tally = Tally("fuzz_proxy_http")
    fake = FakeEngine(default_tokens=3)
    policy = {"admission": {"tenantTokensPerMinute": 1_000_000, "isolatePrefixCache": True},
              "outputLength": {"maxInputTokens": 1000}}
    async with serve_loopback(fake.app()) as url, running_proxy(policy, url) as (_, client):
        headers_st = st.fixed_dictionaries({}, optional={
            "x-priority": st.sampled_from(["interactive", "batch", "BATCH", "", "urgent"]) | st.text(
                alphabet=st.characters(min_codepoint=33, max_codepoint=126), max_size=8),
            "x-tenant": st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), max_size=20)})
        # The proxy shares this test's event loop, so examples are drawn up front and sent here.
        drawn: list[tuple[tuple[str, Any], bytes | None, dict[str, str]]] = []

        @fuzz_settings(200)
        @given(c=st.tuples(CASES, RAW, headers_st))
        def collect(c: tuple[tuple[str, Any], bytes | None, dict[str, str]]) -> None:
            drawn.append(c)

        collect()
        for (path, body), raw, headers in drawn:
            async with client.stream("POST", path, content=_payload(body, raw),
                                     headers={"content-type": "application/json", **headers}) as r:
                data = await r.aread()
            if r.status_code == 200 and r.headers.get("content-type", "").startswith("text/event-stream"):
                seen = classify_events(200, [ln[6:] for ln in data.decode().splitlines() if ln.startswith("data: ")])
            else:
                seen = classify_body(r.status_code, data)
            tally.add(seen)
            _check(seen)
    assert record(tally)["lost"] == 0


# -- configuration ---------------------------------------------------------------------------------
def _documented(tally: Tally, call: Callable[[], object], errors: tuple[type[BaseException], ...],
                message_ok: Callable[[str], bool] = bool) -> None:
    try:
        call()
    except errors as exc:
        ok = message_ok(str(exc))
        tally.add(Seen(Outcome.CLEAN_ERROR if ok else Outcome.LOST, 0, str(exc)[:200]))
        assert ok, f"unclear message: {exc}"
        return
    tally.add(Seen(Outcome.FULL))


def _mutate(doc: Any, rnd: random.Random, wild: list[Any]) -> Any:
    """Replace, drop or add one key somewhere inside a valid document."""
    if not isinstance(doc, dict) or not doc:
        return wild[0]
    doc = dict(doc)
    key = rnd.choice(sorted(doc))
    roll = rnd.random()
    if roll < 0.4 and isinstance(doc[key], dict):
        doc[key] = _mutate(doc[key], rnd, wild)
    elif roll < 0.7:
        doc[key] = wild[0]
    elif roll < 0.85:
        del doc[key]
    else:
        doc[str(wild[1])[:10]] = wild[0]
    return doc


def test_fuzz_policy_file(record: Record) -> None:
    tally = Tally("fuzz_policy")
    full = Policy().to_dict()

    @fuzz_settings(300)
    @given(data=JSON, wild=st.lists(JSON, min_size=2, max_size=2), seed=st.integers(0, 2**32), text=st.text(max_size=80))
    def case(data: Any, wild: list[Any], seed: int, text: str) -> None:
        _documented(tally, lambda: Policy.from_mapping(data), (PolicyError,))
        mutated = _mutate(full, random.Random(seed), wild)
        _documented(tally, lambda: Policy.from_mapping(mutated), (PolicyError,))
        _documented(tally, lambda: Policy.from_yaml(text), (PolicyError,))

    case()
    assert record(tally)["lost"] == 0


def test_fuzz_crd_spec_and_render(record: Record) -> None:
    tally = Tally("fuzz_crd_spec")
    docs = [yaml.safe_load(p.read_text()) for p in sorted(EXAMPLES_DIR.glob("*.yaml"))]
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "ds.yaml"

        @fuzz_settings(200)
        @given(which=st.integers(0, len(docs) - 1), wild=st.lists(JSON, min_size=2, max_size=2),
               seed=st.integers(0, 2**32), depth=st.integers(1, 3))
        def case(which: int, wild: list[Any], seed: int, depth: int) -> None:
            rnd = random.Random(seed)
            spec = docs[which]["spec"]
            for _ in range(depth):
                spec = _mutate(spec, rnd, wild)
            _documented(tally, lambda: validate_spec(spec), (InvalidSpecError,))
            target.write_text(yaml.safe_dump({**docs[which], "spec": spec}))
            err = io.StringIO()
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                try:
                    code = decodectl(["render", "-f", str(target)])
                except SystemExit as exc:
                    code = exc.code if isinstance(exc.code, int) else 1
            clean = code == 0 or (code == 2 and err.getvalue().startswith("decodectl render: error:"))
            tally.add(Seen(Outcome.FULL if code == 0 else Outcome.CLEAN_ERROR if clean else Outcome.LOST, code,
                           err.getvalue()[:200]))
            assert clean, err.getvalue()

        case()
    assert record(tally)["lost"] == 0


def test_fuzz_gguf_headers(record: Record) -> None:
    tally = Tally("fuzz_gguf")
    with tempfile.TemporaryDirectory() as tmp:
        good = write_tiny_gguf(Path(tmp) / "tiny.gguf")[0].read_bytes()
        header_end = good.find(b"token_embd.weight") + 200  # metadata and tensor infos, the parsed part
        target = Path(tmp) / "fuzzed.gguf"

        @fuzz_settings(150)
        @given(kind=st.sampled_from(["truncate", "flip", "random", "overwrite"]), seed=st.integers(0, 2**32),
               junk=st.binary(min_size=1, max_size=64))
        @example(kind="flip", seed=215117, junk=b"\x00")  # a corrupted tokenizer key was a bare KeyError
        def case(kind: str, seed: int, junk: bytes) -> None:
            rnd = random.Random(seed)
            data = bytearray(good)
            if kind == "truncate":
                data = data[: rnd.randrange(len(good))]
            elif kind == "flip":
                for _ in range(rnd.randint(1, 8)):
                    data[rnd.randrange(header_end)] ^= 1 << rnd.randrange(8)
            elif kind == "overwrite":  # e.g. a count or a length field turned huge
                at = rnd.randrange(header_end)
                data[at : at + len(junk)] = junk
            else:
                data = bytearray(b"GGUF" + junk) if rnd.random() < 0.5 else bytearray(junk)
            target.write_bytes(bytes(data))
            _documented(tally, lambda: load_model(target), (ModelLoadError, ConfigError))

        case()
    assert record(tally)["lost"] == 0
