"""The router's settings, checked once when they are built (the CLI turns bad values into exit code 2)."""

from __future__ import annotations

import dataclasses

from decodeservice.proxy.policy import Policy


class RouterConfigError(ValueError):
    """A setting out of range; the message names the flag."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RouterConfig:
    policy: Policy = dataclasses.field(default_factory=Policy)
    hold_seconds: float = 30.0  # how long a request waits for a ready endpoint before a 503
    max_held: int = 256  # requests held at once; the next one gets a 503 at once
    block_size: int = 16  # the engine's KV block size, in tokens: the unit of the prefix index
    scrape_interval_s: float = 1.0  # how often each endpoint's /ready and /metrics are read
    # Per endpoint, the index remembers this many blocks (LRU): 64k blocks of 16 tokens is about a
    # million tokens, more than a CPU replica's KV pool holds, so a block the index forgot is very
    # likely gone from the engine too. About 100 bytes a block.
    max_blocks_per_endpoint: int = 65536

    def __post_init__(self) -> None:
        if not self.hold_seconds >= 0:
            raise RouterConfigError(f"--hold-seconds must be >= 0, got {self.hold_seconds}")
        if self.max_held < 0:
            raise RouterConfigError(f"--max-held must be >= 0, got {self.max_held}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise RouterConfigError(f"--block-size must be a positive power of two, got {self.block_size}")
        if not self.scrape_interval_s > 0:
            raise RouterConfigError(f"--scrape-interval-seconds must be > 0, got {self.scrape_interval_s}")
        if self.max_blocks_per_endpoint < 1:
            raise RouterConfigError("max_blocks_per_endpoint must be >= 1")

    @property
    def ttft_objective_s(self) -> float:
        """The classes' TTFT objective (the policy has one `slo.ttftMs` for every class)."""
        return self.policy.slo.ttft_ms / 1000.0
