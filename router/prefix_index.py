"""Which prompt blocks each endpoint has probably cached: an approximate, bounded, per-endpoint index.

The router records the blocks of every prompt it sends to an endpoint (it cannot see the engine's
cache, so this is what the endpoint was *asked* to compute, as llm-d's approximate prefix scorer
does). A lookup walks the request's chain from the first block and stops at the first block the
endpoint lacks: a chained digest stands for its whole prefix, so the walk's depth is the hit. Each
endpoint's entries are an LRU bounded by `max_blocks`; routing a prompt there again refreshes its
blocks, as the engine's own eviction (least recently freed first) keeps a prefix that keeps being used.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence


class EndpointIndex:
    """One endpoint's blocks, most recently used last."""

    def __init__(self, *, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self._blocks: collections.OrderedDict[int, None] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, blocks: Sequence[int]) -> int:
        """How many leading blocks of `blocks` this endpoint holds."""
        depth = 0
        for block in blocks:
            if block not in self._blocks:
                break
            depth += 1
        return depth

    def record(self, blocks: Iterable[int]) -> None:
        for block in blocks:
            self._blocks[block] = None
            self._blocks.move_to_end(block)
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)


class PrefixIndex:
    """The fleet's indexes by endpoint URL; an endpoint that leaves takes its index with it."""

    def __init__(self, *, max_blocks_per_endpoint: int) -> None:
        self.max_blocks = max_blocks_per_endpoint
        self._by_endpoint: dict[str, EndpointIndex] = {}

    def match(self, endpoint: str, blocks: Sequence[int]) -> int:
        index = self._by_endpoint.get(endpoint)
        return 0 if index is None else index.match(blocks)

    def record(self, endpoint: str, blocks: Sequence[int]) -> None:
        index = self._by_endpoint.get(endpoint)
        if index is None:
            index = self._by_endpoint[endpoint] = EndpointIndex(max_blocks=self.max_blocks)
        index.record(blocks)

    def forget(self, endpoint: str) -> None:
        """A removed endpoint's pod (and its cache) is gone; a new pod on the same address starts cold."""
        self._by_endpoint.pop(endpoint, None)

    def size(self, endpoint: str) -> int:
        index = self._by_endpoint.get(endpoint)
        return 0 if index is None else len(index)
