"""Benchmark datasets (JSONL) and how requests are drawn from them.

A dataset line is one JSON object:

    {"id": "chat-0007", "category": "interactive", "messages": [{"role": "user", "content": "..."}],
     "output_len": 180}

with exactly one of `messages` (sent to /v1/chat/completions) or `prompt` (sent to /v1/completions);
`category` (`interactive` or `batch`) and `output_len` (the answer length this request stands for) are
optional; other keys (such as `reference`) are kept in the file for readers and ignored here.

The shipped datasets `chat`, `summarize` and `mixed` live in `loadgen/datasets/` and are written by
`python -m decodeservice.loadgen.make_datasets` (deterministic; the files are committed).

`--max-tokens` takes one of:

- `N`: every request asks for exactly N tokens;
- `uniform:LO:HI`: a seeded uniform integer in [LO, HI] per request;
- `dataset`: the entry's `output_len`;
- `dataset:CAP`: the entry's `output_len`, capped at CAP (the demo uses this to stay short).
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from decodeservice.loadgen.client import BenchRequest
from decodeservice.loadgen.errors import BenchConfigError

DATASET_DIR = Path(__file__).resolve().parent / "datasets"
SHIPPED = ("chat", "summarize", "mixed")


class Message(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str


class DatasetEntry(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")
    id: str
    category: Literal["interactive", "batch"] = "interactive"
    prompt: str | None = None
    messages: tuple[Message, ...] | None = None
    output_len: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _one_input(self) -> DatasetEntry:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' and 'messages'")
        if self.messages is not None and not self.messages:
            raise ValueError("'messages' is empty")
        return self


def load_dataset(name_or_path: str) -> list[DatasetEntry]:
    """A shipped dataset by name, or a JSONL file; bad content raises `BenchConfigError` naming the line."""
    path = DATASET_DIR / f"{name_or_path}.jsonl" if name_or_path in SHIPPED else Path(name_or_path)
    if not path.is_file():
        raise BenchConfigError(
            f"dataset {name_or_path!r} is neither a shipped dataset ({', '.join(SHIPPED)}) nor a JSONL file"
        )
    entries: list[DatasetEntry] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            entries.append(DatasetEntry.model_validate(json.loads(line)))
        except json.JSONDecodeError as exc:
            raise BenchConfigError(f"{path}:{number}: not JSON: {exc.msg}") from None
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "line"
            raise BenchConfigError(f"{path}:{number}: {where}: {first['msg']}") from None
    if not entries:
        raise BenchConfigError(f"{path}: the dataset is empty")
    return entries


@dataclass(frozen=True, kw_only=True)
class MaxTokens:
    """How many tokens each request asks for; see the module docstring for the syntax."""

    kind: Literal["fixed", "uniform", "dataset"]
    low: int = 1
    high: int = 1
    cap: int | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high:
            raise BenchConfigError(f"max-tokens bounds must satisfy 1 <= low <= high, got {self.low}, {self.high}")
        if self.cap is not None and self.cap < 1:
            raise BenchConfigError("max-tokens cap must be >= 1")

    @classmethod
    def parse(cls, text: str) -> MaxTokens:
        parts = text.strip().split(":")

        def number(raw: str) -> int:
            try:
                return int(raw)
            except ValueError:
                raise BenchConfigError(f"--max-tokens {text!r}: {raw!r} is not an integer") from None

        if len(parts) == 1 and parts[0] != "dataset":
            n = number(parts[0])
            return cls(kind="fixed", low=n, high=n)
        if parts[0] == "uniform" and len(parts) == 3:
            return cls(kind="uniform", low=number(parts[1]), high=number(parts[2]))
        if parts[0] == "dataset" and len(parts) <= 2:
            return cls(kind="dataset", cap=number(parts[1]) if len(parts) == 2 else None)
        raise BenchConfigError(f"--max-tokens {text!r}: use N, uniform:LO:HI, dataset or dataset:CAP")

    def draw(self, entry: DatasetEntry, rng: random.Random) -> int:
        if self.kind == "fixed":
            return self.low
        if self.kind == "uniform":
            return rng.randint(self.low, self.high)
        if entry.output_len is None:
            raise BenchConfigError(f"--max-tokens dataset: entry {entry.id!r} has no output_len")
        return min(entry.output_len, self.cap) if self.cap is not None else entry.output_len

    def describe(self) -> str:
        if self.kind == "fixed":
            return str(self.low)
        if self.kind == "uniform":
            return f"uniform:{self.low}:{self.high}"
        return "dataset" if self.cap is None else f"dataset:{self.cap}"


@dataclass(frozen=True, kw_only=True)
class RequestPlan:
    """The requests of each load level, and how many prompts were sent more than once in the run."""

    levels: tuple[tuple[BenchRequest, ...], ...]
    repeated_prompts: int


def _to_request(entry: DatasetEntry, max_tokens: int, suffix: str) -> BenchRequest:
    messages = None
    if entry.messages is not None:
        messages = tuple((m.role, m.content) for m in entry.messages)
    return BenchRequest(id=f"{entry.id}{suffix}", max_tokens=max_tokens, prompt=entry.prompt, messages=messages)


def plan_requests(
    entries: Sequence[DatasetEntry], *, num_levels: int, num_requests: int, seed: int, max_tokens: MaxTokens
) -> RequestPlan:
    """Draw `num_requests` per level without replacement across the whole run while the dataset lasts.

    Sending the same prompt at two load levels lets a prefix-caching server skip its prefill, so later
    levels would look faster than fresh traffic; we walk one seeded permutation across levels and, only
    when the dataset runs out, start a fresh permutation (and report how many prompts repeat).
    Output lengths use a per-level seed so levels do not share one length sequence either.
    """
    if num_levels < 1 or num_requests < 1:
        raise BenchConfigError("need at least one load level and one request")
    order: list[int] = []
    cycle = 0
    total = num_levels * num_requests
    while len(order) < total:
        perm = list(range(len(entries)))
        random.Random(seed * 7919 + cycle).shuffle(perm)
        order.extend(perm)
        cycle += 1
    levels = []
    for level in range(num_levels):
        rng = random.Random(seed * 1_000_003 + level)
        picks = order[level * num_requests : (level + 1) * num_requests]
        levels.append(tuple(
            _to_request(entries[i], max_tokens.draw(entries[i], rng), f"@{level}.{j}") for j, i in enumerate(picks)
        ))
    return RequestPlan(levels=tuple(levels), repeated_prompts=max(0, total - len(entries)))
