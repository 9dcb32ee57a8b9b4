"""Speculative decoding on the real bundled model: greedy output is bit-identical to plain decoding."""

from __future__ import annotations

from typing import Any

import pytest

from decodeservice.engine import Engine, EngineConfig, SamplingParams, SpeculativeConfig
from tests.conftest import ModelBundle

pytestmark = pytest.mark.model

GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(bundled: ModelBundle) -> list[str]:
    def chat(text: str) -> str:
        return bundled.tokenizer.apply_chat_template([{"role": "user", "content": text}])

    return [
        # Copies from its input: n-gram lookup gets long accepted runs here.
        chat("Fix the spelling and return the whole text: Teh cat sat on teh mat and lookd at the moon. "
             "Then teh cat went to slep."),
        chat("What is the capital of France?"),
        "def fibonacci(n):\n    ",
    ]


@pytest.fixture(scope="module")
def baseline(bundled: ModelBundle, prompts: list[str]) -> list[list[int]]:
    return [o.token_ids for o in bundled.engine().generate(prompts, GREEDY)]


@pytest.mark.parametrize("spec", [
    pytest.param({"method": "ngram", "num_tokens": 5}, id="ngram"),
    # The target drafting for itself: a draft model through the same code path, which accepts a lot.
    pytest.param({"method": "draft", "draft_model": "smollm2-135m", "num_tokens": 3}, id="draft"),
    pytest.param({"method": "self_draft", "draft_layers": 10, "num_tokens": 3}, id="self_draft"),
])
def test_greedy_is_bit_identical_with_speculation(bundled: ModelBundle, prompts: list[str],
                                                  baseline: list[list[int]], spec: dict[str, Any]) -> None:
    # No per-request pause: every method must actually draft and verify here (the pause only changes
    # when drafting happens, never what is generated).
    config = EngineConfig(speculative=SpeculativeConfig.parse({**spec, "draft_row_cost": 0.0}))
    draft = bundled.model if spec["method"] == "draft" else None
    engine = Engine(model=bundled.model, tokenizer=bundled.tokenizer, config=config, draft=draft)
    outputs = [o.token_ids for o in engine.generate(prompts, GREEDY)]
    assert outputs == baseline
    stats = engine.stats().spec_decode
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    if spec["method"] == "ngram":
        # The copying prompt alone: same answer, and drafts taken from its input are accepted.
        alone = Engine(model=bundled.model, tokenizer=bundled.tokenizer, config=config)
        assert alone.generate(prompts[0], GREEDY)[0].token_ids == baseline[0]
        assert alone.stats().spec_decode.num_accepted_tokens > 0
