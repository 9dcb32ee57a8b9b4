"""Speculative decoding behind the server: same greedy text, and the vllm:spec_decode_* counters move."""

from __future__ import annotations

import httpx

from decodeservice.engine import SamplingParams, SpeculativeConfig
from tests.conftest import ModelBundle
from tests.engine.test_server_harness import MODEL, running_server

ENGINE_CONFIG = {"kv_cache_gib": 0.25, "max_model_len": 2048}
REPETITIVE = "one two three one two three one two three one two"  # n-gram drafts get accepted here


def test_ngram_speculation_served(bundled: ModelBundle) -> None:
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    expected = bundled.engine(**ENGINE_CONFIG).generate([REPETITIVE], greedy)[0].text
    spec = SpeculativeConfig(method="ngram", num_tokens=4)
    with running_server(lambda: bundled.engine(speculative=spec, **ENGINE_CONFIG)) as srv:
        body = {"model": MODEL, "prompt": REPETITIVE, "max_tokens": 12, "temperature": 0}
        response = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200
        assert response.json()["choices"][0]["text"] == expected
        drafts = srv.sample("vllm:spec_decode_num_drafts_total")
        proposed = srv.sample("vllm:spec_decode_num_draft_tokens_total")
        accepted = srv.sample("vllm:spec_decode_num_accepted_tokens_total")
        assert drafts > 0 and proposed >= drafts and 0 < accepted <= proposed
        first_position = srv.sample("vllm:spec_decode_num_accepted_tokens_per_pos_total", position="0")
        assert 0 < first_position <= drafts
        # the row cost that sets k was measured at start-up (none configured), and is served
        card = httpx.get(f"{srv.url}/v1/models", timeout=30).json()["data"][0]
        assert card["speculative"]["method"] == "ngram" and card["speculative"]["draft_row_cost_source"] == "measured"
        assert 0 <= card["speculative"]["draft_row_cost"] < 1
