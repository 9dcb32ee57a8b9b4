"""The engine on the real bundled model (SmolLM2-135M-Instruct, Q4_1 GGUF, fp32)."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

from decodeservice.engine import Engine, SamplingParams
from decodeservice.engine.outputs import RequestOutput, StepOutputError
from tests.conftest import ModelBundle

GREEDY_32 = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


def chat(bundle: ModelBundle, text: str) -> str:
    return bundle.tokenizer.apply_chat_template([{"role": "user", "content": text}])


@pytest.fixture(scope="module")
def prompts(bundled: ModelBundle) -> list[str]:
    return [
        chat(bundled, "What is the capital of France?"),
        chat(bundled, "Write a haiku about the sea."),
        "The quick brown fox jumps over the lazy dog. The quick brown",
        "def fibonacci(n):\n    ",
        chat(bundled, "Fix the spelling and return the whole text: Teh cat sat on teh mat and lookd at the moon."),
    ]


@pytest.fixture(scope="module")
def hf_model(bundled_gguf_path: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(bundled_gguf_path.parent), gguf_file=bundled_gguf_path.name, dtype=torch.float32).eval()


def test_greedy_matches_hf_transformers(bundled: ModelBundle, hf_model: Any, prompts: list[str]) -> None:
    ours = bundled.engine().generate(prompts, GREEDY_32)
    for prompt, out in zip(prompts, ours, strict=True):
        ids = torch.tensor([bundled.tokenizer.encode(prompt)])
        with torch.inference_mode():
            theirs = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32,
                                       do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out.token_ids == theirs[0, ids.shape[1]:].tolist(), f"diverged from HF on {prompt!r}"


def test_text_and_finish_reason(bundled: ModelBundle, prompts: list[str]) -> None:
    out = bundled.engine().generate(prompts[0], SamplingParams(max_tokens=32, temperature=0.0))[0]
    assert out.finish_reason == "stop"
    assert "Paris" in out.text
    assert out.token_ids[-1] in bundled.tokenizer.eos_token_ids
    assert out.text == bundled.tokenizer.decode(out.token_ids)


def test_prefix_cache_hit_equals_miss(bundled: ModelBundle, prompts: list[str]) -> None:
    engine = bundled.engine()
    long_prompt = prompts[4] * 3
    miss = engine.generate(long_prompt, GREEDY_32)[0]
    hit = engine.generate(long_prompt, GREEDY_32)[0]
    assert miss.metrics.num_cached_tokens == 0
    assert hit.metrics.num_cached_tokens >= 16 * ((len(miss.prompt_token_ids) - 1) // 16)
    assert hit.token_ids == miss.token_ids
    cold = bundled.engine(enable_prefix_caching=False).generate(long_prompt, GREEDY_32)[0]
    assert cold.token_ids == hit.token_ids


def test_preemption_under_a_tiny_pool(bundled: ModelBundle, prompts: list[str]) -> None:
    alone = [bundled.engine().generate(p, GREEDY_32)[0].token_ids for p in prompts]
    # 16 blocks x 16 tokens: room for about three of these sequences at once, so the scheduler must
    # preempt and recompute; nothing may crash or change.
    engine = bundled.engine(num_gpu_blocks_override=16, max_model_len=256, enable_prefix_caching=False)
    outs = engine.generate(prompts, GREEDY_32)
    assert engine.stats().num_preemptions > 0
    assert [o.token_ids for o in outs] == alone
    assert engine.stats().num_free_blocks == 16


def test_seeded_sampling_is_reproducible(bundled: ModelBundle, prompts: list[str]) -> None:
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    first = bundled.engine().generate(prompts[:2], params)
    # Same seed in a different batch composition: the per-request generator makes it identical.
    second = bundled.engine().generate([prompts[3], prompts[1], prompts[0]], params)
    assert first[0].token_ids == second[2].token_ids
    assert first[1].token_ids == second[1].token_ids


def test_stop_strings_and_ids(bundled: ModelBundle, prompts: list[str]) -> None:
    engine = bundled.engine()
    base = engine.generate(prompts[2], GREEDY_32)[0]
    word = base.text.split()[2]
    stopped = engine.generate(prompts[2], SamplingParams(max_tokens=32, temperature=0.0, stop=(word,)))[0]
    assert stopped.finish_reason == "stop"
    assert word not in stopped.text and base.text.startswith(stopped.text)
    by_id = engine.generate(prompts[2], SamplingParams(max_tokens=32, temperature=0.0,
                                                       stop_token_ids=(base.token_ids[3],)))[0]
    assert by_id.finish_reason == "stop" and by_id.token_ids == base.token_ids[:4]


def test_abort_frees_blocks_immediately(bundled: ModelBundle, prompts: list[str]) -> None:
    engine = bundled.engine()
    total = engine.stats().num_free_blocks
    request_id = engine.add_request(prompts[0] * 4, SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))
    engine.step()
    assert engine.stats().num_free_blocks < total
    assert engine.abort_request(request_id)
    assert engine.stats().num_free_blocks == total
    assert not engine.has_unfinished_requests()


def test_logprobs(bundled: ModelBundle, prompts: list[str]) -> None:
    out = bundled.engine().generate(prompts[1], SamplingParams(max_tokens=4, temperature=0.0, logprobs=3))[0]
    assert out.logprobs is not None and len(out.logprobs) == 4
    for token, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp.token_id == token and len(lp.top) == 3
        assert max(lp.top, key=lp.top.__getitem__) == token  # greedy picks the top choice
        assert lp.logprob <= 0.0


def test_from_pretrained_by_name_and_path(bundled_gguf_path: Path) -> None:
    engine = Engine.from_pretrained(str(bundled_gguf_path), max_model_len=512, kv_cache_gib=0.05)
    assert engine.max_model_len == 512
    assert engine.generate("Hi", SamplingParams(max_tokens=2, temperature=0.0))[0].token_ids


def test_step_outputs_are_deltas_and_the_finished_one_carries_the_totals(bundled: ModelBundle,
                                                                         prompts: list[str]) -> None:
    engine = bundled.engine()
    # A stop string that never matches still holds text back, so some steps add tokens but no text.
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=1, stop=("@@@@",))
    request_id = engine.add_request(prompts[3], params)
    outs: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert all(o.request_id == request_id for o in outs)
    *steps, final = outs
    assert final.finished and final.finish_reason == "length" and not any(o.finished for o in steps)
    assert final.token_ids == [t for o in outs for t in o.new_token_ids] and len(final.token_ids) == 24
    assert final.text == "".join(o.new_text for o in outs) == bundled.tokenizer.decode(final.token_ids)
    assert final.logprobs == [lp for o in outs for lp in o.new_logprobs or []]
    assert [lp.token_id for lp in final.logprobs] == final.token_ids
    counts = [o.num_output_tokens for o in outs]
    assert counts == list(itertools.accumulate(len(o.new_token_ids) for o in outs))
    with pytest.raises(StepOutputError, match="delta"):
        _ = steps[0].token_ids
    again = engine.generate(prompts[3], params)[0]  # generate hands back the same finished output
    assert (again.token_ids, again.text, again.logprobs) == (final.token_ids, final.text, final.logprobs)
