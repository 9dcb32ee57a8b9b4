"""Property test of the block allocator (no leak, no double free, no writable block shared), and the
prefix-cache key: a cryptographic chain, salted per request."""

from __future__ import annotations

import hashlib
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from decodeservice.engine.kv_cache import KVCacheManager, chain_hash, root_hash
from decodeservice.engine.sampling_params import SamplingParams
from decodeservice.engine.sequence import Sequence

BLOCK = 4
NUM_BLOCKS = 12


class AllocatorMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(num_blocks=NUM_BLOCKS, block_size=BLOCK, enable_prefix_caching=True)
        self.live: list[Sequence] = []
        self.count = 0

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=20))
    def admit(self, tokens: list[int]) -> None:
        # A tiny alphabet makes shared prefixes, and so cache hits, common.
        self.count += 1
        seq = Sequence(request_id=f"r{self.count}", prompt_token_ids=tokens, params=SamplingParams())
        cached = self.kv.find_cached_prefix(seq)
        if self.kv.allocate_slots(seq, seq.num_tokens - len(cached) * BLOCK, cached):
            seq.num_computed_tokens = seq.num_tokens
            self.kv.cache_full_blocks(seq)
            self.live.append(seq)
        else:
            assert not seq.block_ids, "a failed allocation must leave the sequence untouched"

    @precondition(lambda self: self.live)
    @rule(data=st.data(), new=st.lists(st.integers(0, 2), min_size=1, max_size=6))
    def grow(self, data: st.DataObject, new: list[int]) -> None:
        seq = data.draw(st.sampled_from(self.live))
        if self.kv.allocate_slots(seq, len(new)):
            seq.output_token_ids.extend(new)
            seq.num_computed_tokens = seq.num_tokens
            self.kv.cache_full_blocks(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), drop=st.integers(1, 6))
    def speculate_and_roll_back(self, data: st.DataObject, drop: int) -> None:
        seq = data.draw(st.sampled_from(self.live))
        if self.kv.allocate_slots(seq, drop):  # slots for drafts that will all be rejected
            self.kv.truncate(seq, seq.num_computed_tokens)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.live))
        self.live.remove(seq)
        self.kv.free(seq)

    @invariant()
    def blocks_are_accounted_for(self) -> None:
        owners = Counter(b for seq in self.live for b in seq.block_ids)
        for block in self.kv.blocks:
            assert block.ref_count == owners.get(block.block_id, 0), "ref count != number of owners"
            in_free_queue = block.block_id in self.kv._free
            assert in_free_queue == (block.ref_count == 0), "free queue and ref counts disagree"
            if owners.get(block.block_id, 0) > 1:
                assert block.block_hash is not None, "a writable block is owned by two live sequences"
        for seq in self.live:
            assert len(seq.block_ids) == len(set(seq.block_ids))
            assert len(seq.block_ids) == self.kv.blocks_needed(seq.num_computed_tokens)

    def teardown(self) -> None:
        for seq in self.live:
            self.kv.free(seq)
        assert self.kv.num_free_blocks == NUM_BLOCKS, "blocks leaked"


AllocatorMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestAllocator = AllocatorMachine.TestCase


def test_cached_blocks_survive_free_and_are_revived() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK)
    first = Sequence(request_id="a", prompt_token_ids=list(range(9)), params=SamplingParams())
    assert kv.allocate_slots(first, 9)
    first.num_computed_tokens = 9
    kv.cache_full_blocks(first)
    kv.free(first)
    assert kv.num_free_blocks == 4 and kv.usage == 0.0
    second = Sequence(request_id="b", prompt_token_ids=list(range(9)), params=SamplingParams())
    cached = kv.find_cached_prefix(second)
    assert len(cached) == 2  # two full blocks; the last token is always recomputed
    assert kv.allocate_slots(second, 1, cached)
    assert second.block_ids[:2] == cached and second.num_computed_tokens == 8


def test_double_free_is_caught() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=BLOCK)
    seq = Sequence(request_id="a", prompt_token_ids=[1, 2], params=SamplingParams())
    assert kv.allocate_slots(seq, 2)
    blocks = list(seq.block_ids)
    kv.free(seq)
    seq.block_ids = blocks
    with pytest.raises(AssertionError, match="double free"):
        kv.free(seq)


# -- the prefix-cache key (GHSA-rm76-4mrf-v9r8) -----------------------------------------------------
def _cached_after(kv: KVCacheManager, first: Sequence, second: Sequence) -> list[int]:
    """Publish `first`'s blocks, free it, and return the blocks `second` would be served from cache."""
    assert kv.allocate_slots(first, first.num_tokens)
    first.num_computed_tokens = first.num_tokens
    kv.cache_full_blocks(first)
    kv.free(first)
    return kv.find_cached_prefix(second)


def _seq(request_id: str, tokens: list[int], salt: str | None = None) -> Sequence:
    return Sequence(request_id=request_id, prompt_token_ids=tokens, params=SamplingParams(), cache_salt=salt)


def test_a_python_hash_collision_is_not_a_cache_hit() -> None:
    # CPython hashes an int modulo 2**61 - 1, so 0 and 2**61 - 1 hash alike, and so do the tuples
    # the old key was built from: the old cache would have served one prompt the other's K/V.
    victim, attacker = [0, 1, 2, 3, 4], [2**61 - 1, 1, 2, 3, 4]
    assert hash((None, tuple(victim[:BLOCK]))) == hash((None, tuple(attacker[:BLOCK])))
    assert chain_hash(root_hash(), victim[:BLOCK]) != chain_hash(root_hash(), attacker[:BLOCK])
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK)
    assert _cached_after(kv, _seq("victim", victim), _seq("attacker", attacker)) == []
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK)
    assert len(_cached_after(kv, _seq("a", victim), _seq("b", list(victim)))) == 1  # the control: a hit


def test_chain_hash_is_sha256_over_a_canonical_encoding() -> None:
    parent = root_hash("tenant-a")
    tokens = [1, 2, 70000, 2**40]
    encoded = parent + (4).to_bytes(4, "little") + b"".join(t.to_bytes(8, "little") for t in tokens)
    assert chain_hash(parent, tokens) == hashlib.sha256(encoded).digest()
    assert chain_hash(parent, tokens) == chain_hash(root_hash("tenant-a"), tuple(tokens))  # deterministic
    assert len(chain_hash(parent, tokens)) == 32


@given(a=st.lists(st.integers(0, 2**32), max_size=6), b=st.lists(st.integers(0, 2**32), max_size=6),
       salt_a=st.none() | st.text(max_size=4), salt_b=st.none() | st.text(max_size=4))
@settings(max_examples=200, deadline=None)
def test_keys_differ_exactly_when_inputs_differ(a: list[int], b: list[int], salt_a: str | None,
                                                salt_b: str | None) -> None:
    same_inputs = a == b and salt_a == salt_b
    assert (chain_hash(root_hash(salt_a), a) == chain_hash(root_hash(salt_b), b)) == same_inputs


def test_salts_separate_prefixes() -> None:
    tokens = list(range(9))
    for first_salt, second_salt, hits in [("a", "a", 2), ("a", "b", 0), (None, None, 2), (None, "", 0),
                                           ("", None, 0), ("a", None, 0)]:
        kv = KVCacheManager(num_blocks=4, block_size=BLOCK)
        cached = _cached_after(kv, _seq("x", tokens, first_salt), _seq("y", tokens, second_salt))
        assert len(cached) == hits, (first_salt, second_salt)
    # The salt is only the chain's root: a salted sequence's later blocks chain from its own first block.
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK)
    assert len(_cached_after(kv, _seq("x", tokens, "s"), _seq("y", tokens[:4] + [99] * 5, "s"))) == 1
