"""What a client saw, counted: a full answer, a clean OpenAI-JSON error, or lost.

Shared by the CI subset (`tests/reliability/`) and the long runs (`benchmarks/reliability.py`). A
request is *lost* when it hangs past its deadline, when a stream breaks without a terminal error
event, or when an error is not OpenAI error JSON; everything else *survived*.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import json
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families


class Outcome(enum.StrEnum):
    FULL = "full"  # a complete answer: a finish_reason (and [DONE] when streamed)
    CLEAN_ERROR = "clean_error"  # OpenAI error JSON: a status >= 400, or an SSE error event, then the end
    DISCONNECTED = "disconnected"  # the client left on purpose (a fault we injected); nothing to see
    LOST = "lost"


@dataclasses.dataclass
class Seen:
    outcome: Outcome
    status: int = 0
    detail: str = ""
    error_code: str | None = None


def is_openai_error(obj: Any) -> bool:
    error = obj.get("error") if isinstance(obj, dict) else None
    return (isinstance(error, dict) and isinstance(error.get("message"), str) and bool(error["message"])
            and isinstance(error.get("type"), str) and "code" in error and "param" in error)


def classify_body(status: int, body: bytes) -> Seen:
    """A non-streamed answer."""
    try:
        obj = json.loads(body)
    except ValueError:
        return Seen(Outcome.LOST, status, f"not JSON: {body[:200]!r}")
    if status >= 400:
        if is_openai_error(obj):
            return Seen(Outcome.CLEAN_ERROR, status, obj["error"]["message"], obj["error"]["code"])
        return Seen(Outcome.LOST, status, f"error without OpenAI JSON: {body[:200]!r}")
    choices = obj.get("choices") if isinstance(obj, dict) else None
    if status == 200 and choices and choices[0].get("finish_reason"):
        return Seen(Outcome.FULL, status)
    return Seen(Outcome.LOST, status, f"no finish_reason: {body[:200]!r}")


def classify_events(status: int, events: list[str]) -> Seen:
    """A streamed answer: the `data:` payloads in order."""
    finished = False
    for i, data in enumerate(events):
        if data == "[DONE]":
            return Seen(Outcome.FULL if finished else Outcome.LOST, status, "" if finished else "[DONE] early")
        chunk = json.loads(data)
        if is_openai_error(chunk):
            tail = events[i + 1:]
            ok = tail in ([], ["[DONE]"])  # an error event ends the stream
            return Seen(Outcome.CLEAN_ERROR if ok else Outcome.LOST, status, chunk["error"]["message"],
                        chunk["error"]["code"])
        finished = finished or any(c.get("finish_reason") for c in chunk.get("choices", []))
    return Seen(Outcome.LOST, status, "the stream ended without [DONE] or an error event")


async def request(client: httpx.AsyncClient, path: str, body: dict[str, Any], *, headers: dict[str, str] | None = None,
                  deadline_s: float = 60.0, stop_after_chunks: int | None = None,
                  on_event: Callable[[str], None] | None = None) -> Seen:
    """Send one request and classify what came back. `stop_after_chunks`: disconnect after that many
    SSE events (a client that goes away). Past `deadline_s` the request counts as lost (a hang)."""
    try:
        async with asyncio.timeout(deadline_s):
            if not body.get("stream"):
                r = await client.post(path, json=body, headers=headers)
                return classify_body(r.status_code, r.content)
            async with client.stream("POST", path, json=body, headers=headers) as r:
                if r.status_code != 200:
                    return classify_body(r.status_code, await r.aread())
                events: list[str] = []
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        if on_event is not None:
                            on_event(line[6:])
                        if stop_after_chunks is not None and len(events) >= stop_after_chunks:
                            return Seen(Outcome.DISCONNECTED, r.status_code)
                return classify_events(r.status_code, events)
    except TimeoutError:
        return Seen(Outcome.LOST, 0, f"no answer within {deadline_s}s")
    except httpx.HTTPError as exc:  # the connection broke with nothing OpenAI-shaped said
        return Seen(Outcome.LOST, 0, f"{type(exc).__name__}: {exc}")


@dataclasses.dataclass
class Tally:
    """tried = survived + lost; a disconnect we injected counts as survived when the server cleaned up."""

    scenario: str
    seen: list[Seen] = dataclasses.field(default_factory=list)

    def add(self, *seen: Seen) -> None:
        self.seen.extend(seen)

    @property
    def tried(self) -> int:
        return len(self.seen)

    @property
    def lost(self) -> int:
        return sum(s.outcome is Outcome.LOST for s in self.seen)

    def summary(self) -> dict[str, Any]:
        kinds = Counter(s.outcome.value for s in self.seen)
        statuses = Counter(str(s.status) for s in self.seen)
        lost = [s.detail for s in self.seen if s.outcome is Outcome.LOST][:5]
        return {"scenario": self.scenario, "tried": self.tried, "survived": self.tried - self.lost,
                "lost": self.lost, "outcomes": dict(kinds), "statuses": dict(statuses),
                **({"lost_examples": lost} if lost else {})}


def scrape(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a Prometheus text page, keyed by (name, sorted labels)."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def total(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    """Sum of `name` over every label set that includes `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))
