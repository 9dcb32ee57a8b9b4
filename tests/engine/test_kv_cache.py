"""Property test of the block allocator: no leak, no double free, no writable block shared."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from decodeservice.engine.kv_cache import KVCacheManager
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
