"""Block bookkeeping for the paged KV cache, with prefix caching.

The K/V tensors live in the model runner; this module only decides which block ids a sequence owns.

Prefix caching works on full blocks. A full block's identity is a chained SHA-256 digest of its parent
block's digest and its own token ids (see `chain_hash`), so equal digests mean equal prefixes: a hit is
served without comparing tokens, which is sound only because finding a collision in SHA-256 is
infeasible. (Python's 64-bit `hash()` was used before; it is not collision resistant, so a crafted
prompt could collide with another tenant's prefix and read or poison its K/V, as in vLLM's advisory
GHSA-rm76-4mrf-v9r8.) An optional per-request cache salt enters the root of the chain, so requests
with different salts never share a block. Blocks are reference-counted: a
cached prefix can back many live sequences at once. A block whose count drops to zero goes to the
free queue but keeps its hash, so a later request can revive it until it is evicted (least recently
freed first; blocks without a hash are evicted before any cached one).
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from decodeservice.engine.sequence import Sequence


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None


BlockHash = bytes  # a 32-byte SHA-256 digest
_ROOT_DOMAIN = b"decodeservice.kv-prefix.v1\x00"


def root_hash(cache_salt: str | None = None) -> BlockHash:
    """The parent digest of a sequence's first block. The salt is tagged so that no salt and every
    salt (the empty string included) give different roots."""
    if cache_salt is None:
        return hashlib.sha256(_ROOT_DOMAIN + b"\x00").digest()
    return hashlib.sha256(_ROOT_DOMAIN + b"\x01" + cache_salt.encode("utf-8", "surrogatepass")).digest()


def chain_hash(parent: BlockHash, token_ids: Seq[int]) -> BlockHash:
    """SHA-256 over a canonical encoding: the parent's 32-byte digest, the block's token count as a
    little-endian uint32, then each token id as a little-endian uint64. Fixed-width fields make the
    encoding injective, so only a SHA-256 collision can make two different prefixes share a key."""
    tokens = array("Q", token_ids)  # OverflowError on a negative id: token ids are checked upstream
    if sys.byteorder == "big":
        tokens.byteswap()
    digest = hashlib.sha256(parent)
    digest.update(len(tokens).to_bytes(4, "little"))
    digest.update(tokens.tobytes())
    return digest.digest()


class KVCacheManager:
    def __init__(self, *, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[BlockHash, int] = {}  # block digest -> block id
        self._seq_hashes: dict[str, list[BlockHash]] = {}  # request id -> digests of its full, computed blocks
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
        parent = root_hash(seq.cache_salt)
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
        if needed > 0:
            seq.block_ids.extend(self._pop_free_run(needed, after=seq.block_ids[-1] if seq.block_ids else None))
        return True

    def record_prefix_lookup(self, *, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_prompt_tokens
        self.prefix_hits += num_hit_tokens

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Publish every full block whose tokens are all computed, so later requests can share it."""
        if not self.enable_prefix_caching:
            return
        hashes = self._seq_hashes.setdefault(seq.request_id, [])
        # A sequence that stopped inside a verified run has fewer tokens than computed slots.
        num_full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        if len(hashes) >= num_full:
            return
        tokens = seq.token_ids
        parent = hashes[-1] if hashes else root_hash(seq.cache_salt)
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

    def _pop_free_run(self, count: int, *, after: int | None) -> list[int]:
        """`count` free blocks, laid out so attention can read them as few runs of consecutive slots.

        The block right after the sequence's last one is taken first when it is free and holds no
        cached prefix (taking it evicts nothing). The rest are the least recently freed blocks, as
        always, but sorted: a finished sequence frees its blocks tail first, so in LRU order they come
        back descending, and one block per attention call would follow."""
        taken: list[int] = []
        nxt = None if after is None else after + 1
        if nxt is not None and nxt < self.num_blocks and nxt in self._free and self.blocks[nxt].block_hash is None:
            del self._free[nxt]
            taken.append(self._reset(nxt))
        rest = [self._pop_free() for _ in range(count - len(taken))]
        return taken + sorted(rest)

    def _pop_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        return self._reset(block_id)

    def _reset(self, block_id: int) -> int:
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
