"""Cost of the prefix-cache key: SHA-256 chained block digests against the old Python `hash()`.

    .venv/bin/python -P benchmarks/prefix_hash.py --tokens 4096 --repeats 200 --out benchmarks/results/prefix_hash.json

Both keys are computed the way the KV manager walks a prompt: one chained digest per full block of
`--block-size` tokens. Prints one JSON object with ns/token for each and their ratio; a prompt's keys
are computed once when it is admitted (lookup) and once as its blocks fill (publication).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from decodeservice.engine.kv_cache import chain_hash, root_hash

sys.path.insert(0, str(Path(__file__).parent))  # `python -P` leaves the script's folder off the path
from json_out import emit


def _old_chain_hash(parent: int | None, token_ids: Sequence[int]) -> int:
    return hash((parent, tuple(token_ids)))  # the key before GHSA-rm76-4mrf-v9r8 was fixed here


def _walk_sha(tokens: list[int], block_size: int) -> None:
    parent = root_hash()
    for i in range(len(tokens) // block_size):
        parent = chain_hash(parent, tokens[i * block_size : (i + 1) * block_size])


def _walk_old(tokens: list[int], block_size: int) -> None:
    parent: int | None = None
    for i in range(len(tokens) // block_size):
        parent = _old_chain_hash(parent, tokens[i * block_size : (i + 1) * block_size])


def _ns_per_token(walk: Callable[[list[int], int], None], tokens: list[int], block_size: int,
                  repeats: int) -> list[float]:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        walk(tokens, block_size)
        samples.append((time.perf_counter_ns() - start) / len(tokens))
    return samples


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    rng = random.Random(0)
    tokens = [rng.randrange(49152) for _ in range(args.tokens)]  # SmolLM2's vocabulary size
    # Interleaved rounds, so both peers see the same machine load (the CPUs are shared).
    sha: list[float] = []
    old: list[float] = []
    for _ in range(5):
        sha += _ns_per_token(_walk_sha, tokens, args.block_size, args.repeats // 5)
        old += _ns_per_token(_walk_old, tokens, args.block_size, args.repeats // 5)
    result = {
        "benchmark": "prefix_hash", "tokens": args.tokens, "block_size": args.block_size, "repeats": len(sha),
        "sha256_ns_per_token": {"median": statistics.median(sha), "min": min(sha)},
        "python_hash_ns_per_token": {"median": statistics.median(old), "min": min(old)},
        "sha256_over_python_hash": statistics.median(sha) / statistics.median(old),
        "sha256_us_per_4k_prompt": statistics.median(sha) * 4096 / 1000,
    }
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
