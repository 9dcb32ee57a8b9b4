"""Block bookkeeping for the paged KV cache, with prefix caching.

The K/V tensors live in the model runner; this module only decides which block ids a sequence owns.

Prefix caching works on full blocks. A full block's identity is a chained hash of its parent block's
hash and its own token ids, so equal hashes mean equal prefixes. Blocks are reference-counted: a
cached prefix can back many live sequences at once. A block whose count drops to zero goes to the
free queue but keeps its hash, so a later request can revive it until it is evicted (least recently
freed first; blocks without a hash are evicted before any cached one).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from decodeservice.engine.sequence import Sequence


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None


def chain_hash(parent_hash: int | None, token_ids: Seq[int]) -> int:
    # Python's hash of a tuple of ints is deterministic across processes (no hash randomisation).
    return hash((parent_hash, tuple(token_ids)))


class KVCacheManager:
    def __init__(self, *, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id
        self._seq_hashes: dict[str, list[int]] = {}  # request id -> hashes of its full, computed blocks
        self.prefix_queries = 0
        self.prefix_hits = 0

    # -- queries -----------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids that already hold a prefix of `seq`. Nothing is claimed yet."""
        if not self.enable_prefix_caching:
            return []
        tokens = seq.token_ids
        # The last token must be computed to produce logits, so it is never served from the cache.
        max_blocks = (len(tokens) - 1) // self.block_size
        hits: list[int] = []
        parent: int | None = None
        for i in range(max_blocks):
            parent = chain_hash(parent, tokens[i * self.block_size : (i + 1) * self.block_size])
            block_id = self._cached.get(parent)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    # -- allocation --------------------------------------------------------------------------------
    def allocate_slots(self, seq: Sequence, num_new_tokens: int, cached_blocks: Seq[int] = ()) -> bool:
        """Make `seq` own enough blocks for num_computed + num_new tokens. False (and no change) if
        the pool cannot cover it; the caller then preempts or waits."""
        if cached_blocks:
            assert not seq.block_ids, "a cached prefix is only claimed on admission"
        num_computed = len(cached_blocks) * self.block_size if cached_blocks else seq.num_computed_tokens
        needed = self.blocks_needed(num_computed + num_new_tokens) - len(seq.block_ids) - len(cached_blocks)
        revived = sum(1 for b in cached_blocks if self.blocks[b].ref_count == 0)
        if needed > len(self._free) - revived:
            return False
        if cached_blocks:
            for block_id in cached_blocks:
                self._claim(block_id)
            seq.block_ids = list(cached_blocks)
            seq.num_computed_tokens = num_computed
            seq.num_cached_tokens = num_computed
            self._seq_hashes[seq.request_id] = [self.blocks[b].block_hash for b in cached_blocks]  # type: ignore[misc]
        for _ in range(max(needed, 0)):
            seq.block_ids.append(self._pop_free())
        return True

    def record_prefix_lookup(self, *, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_prompt_tokens
        self.prefix_hits += num_hit_tokens

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Publish every full block whose tokens are all computed, so later requests can share it."""
        if not self.enable_prefix_caching:
            return
        hashes = self._seq_hashes.setdefault(seq.request_id, [])
        num_full = seq.num_computed_tokens // self.block_size
        if len(hashes) >= num_full:
            return
        tokens = seq.token_ids
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), num_full):
            parent = chain_hash(parent, tokens[i * self.block_size : (i + 1) * self.block_size])
            hashes.append(parent)
            block = self.blocks[seq.block_ids[i]]
            if block.block_hash is None and parent not in self._cached:
                block.block_hash = parent
                self._cached[parent] = block.block_id

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Roll back to `num_tokens` valid tokens (rejected speculative slots), returning spare blocks."""
        keep = self.blocks_needed(num_tokens)
        spare = seq.block_ids[keep:]
        del seq.block_ids[keep:]
        for block_id in reversed(spare):
            self._release(block_id)
        hashes = self._seq_hashes.get(seq.request_id)
        if hashes is not None:
            del hashes[num_tokens // self.block_size :]

    def free(self, seq: Sequence) -> None:
        # Reverse order: the tail of a sequence is the least likely to be shared, so evict it first.
        for block_id in reversed(seq.block_ids):
            self._release(block_id)
        seq.block_ids = []
        self._seq_hashes.pop(seq.request_id, None)

    # -- internals ---------------------------------------------------------------------------------
    def _claim(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def _pop_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) == block_id:
                del self._cached[block.block_hash]
            block.block_hash = None
        block.ref_count = 1
        return block_id

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"double free of block {block_id}"
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block_id] = None
            if block.block_hash is None:
                self._free.move_to_end(block_id, last=False)  # nothing to reuse: evict first


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for non-negative ints, e.g. the blocks that hold a tokens: the project's one spelling."""
    return -(-a // b)
