"""Prompt keys and the prefix index: shared prefixes share blocks, tenants never do."""

from __future__ import annotations

import pytest

from decodeservice.common.errors import BadRequest
from decodeservice.proxy.prefix_isolation import tenant_salt
from decodeservice.router.prefix_index import EndpointIndex, PrefixIndex
from decodeservice.router.prompt_keys import CHARS_PER_TOKEN, prompt_keys

DOC = "The quick brown fox jumps over the lazy dog. " * 60  # about 680 tokens


def chat(*turns: str, system: str = "You are terse.") -> dict[str, object]:
    messages = [{"role": "system", "content": system}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return {"messages": messages}


def test_a_later_turn_extends_the_blocks_of_the_earlier_one() -> None:
    first = prompt_keys(chat(DOC + "Summarise."), block_size=16, salt=None)
    second = prompt_keys(chat(DOC + "Summarise.", "It is about a fox.", "And the dog?"), block_size=16, salt=None)
    assert len(first.blocks) >= 40
    assert second.blocks[: len(first.blocks)] == first.blocks
    assert len(second.blocks) > len(first.blocks)
    assert first.conversation == second.conversation  # the conversation key survives the turns
    assert first.tokens == pytest.approx(len(str(chat(DOC + "Summarise.")["messages"])) / CHARS_PER_TOKEN, rel=0.1)


def test_conversations_with_their_own_documents_share_only_the_system_prompt() -> None:
    system = "You answer questions about the document the user gives you. " * 4
    a = prompt_keys(chat("doc A " + DOC, system=system), block_size=16, salt=None)
    b = prompt_keys(chat("doc B " + DOC, system=system), block_size=16, salt=None)
    shared = next(i for i, (x, y) in enumerate(zip(a.blocks, b.blocks, strict=False)) if x != y)
    common = f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\ndoc "  # the layout's shared text
    assert shared == len(common) // (16 * CHARS_PER_TOKEN)
    assert a.conversation != b.conversation


def test_token_id_prompts_are_cut_into_blocks_of_ids_as_the_engine_does() -> None:
    keys = prompt_keys({"prompt": list(range(50))}, block_size=16, salt=None)
    assert (len(keys.blocks), keys.tokens) == (3, 50)
    longer = prompt_keys({"prompt": list(range(70))}, block_size=16, salt=None)
    assert longer.blocks[:3] == keys.blocks


def test_a_salt_gives_the_same_prompt_other_keys() -> None:
    body = chat(DOC)
    plain = prompt_keys(body, block_size=16, salt=None)
    acme = prompt_keys(body, block_size=16, salt=tenant_salt("acme"))
    other = prompt_keys(body, block_size=16, salt=tenant_salt("globex"))
    assert not set(plain.blocks) & set(acme.blocks)
    assert not set(acme.blocks) & set(other.blocks)
    assert acme.blocks == prompt_keys(body, block_size=16, salt=tenant_salt("acme")).blocks


def test_the_index_never_lends_one_tenants_blocks_to_another() -> None:
    index = PrefixIndex(max_blocks_per_endpoint=10_000)
    body = chat(DOC)
    acme = prompt_keys(body, block_size=16, salt=tenant_salt("acme"))
    globex = prompt_keys(body, block_size=16, salt=tenant_salt("globex"))
    index.record("http://a", acme.blocks)
    assert index.match("http://a", acme.blocks) == len(acme.blocks)
    assert index.match("http://a", globex.blocks) == 0
    assert index.match("http://b", acme.blocks) == 0
    index.forget("http://a")
    assert index.match("http://a", acme.blocks) == 0


def test_the_endpoint_index_is_a_bounded_lru_and_a_match_is_a_prefix() -> None:
    index = EndpointIndex(max_blocks=4)
    index.record([1, 2, 3])
    assert index.match([1, 2, 9, 3]) == 2
    index.record([1])  # refreshed: now the most recent
    index.record([4, 5])  # evicts the least recent: 2
    assert len(index) == 4
    assert index.match([1, 2]) == 1
    assert index.match([4, 5]) == 2
    assert index.match([2, 3]) == 0  # 3 is there, but the walk stops at the first block missing


@pytest.mark.parametrize("body", [{"messages": "hi"}, {"messages": []}, {"messages": ["hi"]}, {"prompt": 5},
                                  {"prompt": [1, "a"]}])
def test_a_prompt_of_the_wrong_shape_is_a_400(body: dict[str, object]) -> None:
    with pytest.raises(BadRequest):
        prompt_keys(body, block_size=16, salt=None)
