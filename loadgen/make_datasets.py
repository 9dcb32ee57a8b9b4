"""Write the shipped datasets: `python -m decodeservice.loadgen.make_datasets [--out DIR]`.

Deterministic (fixed seeds, no clock, no network): running it again rewrites identical files.

- `chat`: short user questions that want a medium answer (output 48 to 320 tokens).
- `summarize`: long documents (incident reports, meeting notes, reviews) with an instruction to quote
  the key sentences verbatim, so the answer copies from the prompt (`reference` holds those sentences;
  an n-gram speculator thrives on this). Output 128 to 384 tokens.
- `mixed`: interactive chat (about 60%) and batch document work (about 40%), output lengths from a log-normal
  spread clipped to [16, 600], as a production mix has a long tail of long answers.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from decodeservice.loadgen.dataset import DATASET_DIR

SYSTEM = "You are a helpful, concise assistant."

QUESTIONS = [
    "How do I reverse a linked list in {lang}? Show the code and explain each step.",
    "What is the difference between a process and a thread, and when would I pick one in {lang}?",
    "Write a {lang} function that checks whether a string is a palindrome, ignoring punctuation.",
    "Explain how a hash map handles collisions, with an example in {lang}.",
    "My {lang} program gets slower the longer it runs. What should I check first?",
    "Give me three ways to read a large CSV file in {lang} without running out of memory.",
    "How does garbage collection work in {lang}, in plain words?",
    "What are good unit-testing habits for a small {lang} project?",
    "Can you explain {topic} to a first-year student?",
    "What are the main trade-offs of {topic}?",
    "Summarize the history of {topic} in a few paragraphs.",
    "What is a common misconception about {topic}, and what is actually true?",
    "I have an interview tomorrow about {topic}. What questions should I prepare for?",
    "Write a short, friendly email to my {person} asking to move our meeting to {day}.",
    "Help me write a polite message declining an invitation from my {person} for {day}.",
    "Plan a {n}-day trip to {city} for someone who likes food and museums.",
    "What should I pack for a weekend hiking trip near {city} in {season}?",
    "Suggest a simple {meal} recipe using {ingredient} that takes under 30 minutes.",
    "I only have {ingredient}, rice and eggs. What can I cook for {meal}?",
    "How can I get better sleep when I work late shifts?",
    "Write a haiku about {season} in {city}.",
    "Give me a short story opening about a {person} who finds a strange key.",
    "Translate 'where is the train station, please?' into {language} and explain the grammar.",
    "What are five useful phrases for a beginner learning {language}?",
    "Compare renting and buying a home in a city like {city}.",
    "How do I start running if I have never exercised before?",
    "Explain compound interest with a worked example using {n} years.",
    "What is the best way to learn {lang} in {n} weeks if I already know another language?",
    "Review this idea: a {lang} command-line tool that renames photos by the date they were taken.",
    "Why does my {lang} code say 'index out of range' when I loop over a list and remove items?",
    "How would you explain {topic} using an analogy from cooking?",
    "Write a product description for a handmade {ingredient}-themed notebook, under 100 words.",
    "My {person} keeps interrupting me in meetings. How can I bring it up kindly?",
    "What are some cheap things to do in {city} on a rainy day in {season}?",
    "Draft a {n}-point checklist for moving to a new apartment.",
]
FILL: dict[str, list[str]] = {
    "lang": ["Python", "Rust", "Go", "Java", "TypeScript", "C++", "Kotlin"],
    "topic": ["photosynthesis", "public-key cryptography", "inflation", "plate tectonics", "vaccines",
              "the TCP handshake", "black holes", "supply and demand", "neural networks", "the immune system",
              "version control", "climate feedback loops", "database indexes", "the French Revolution"],
    "person": ["manager", "landlord", "colleague", "teacher", "neighbour", "client"],
    "day": ["Monday", "Tuesday", "Thursday", "Friday", "next week"],
    "city": ["Lisbon", "Kyoto", "Montreal", "Cape Town", "Edinburgh", "Oaxaca", "Seoul", "Vienna"],
    "season": ["spring", "summer", "autumn", "winter"],
    "meal": ["breakfast", "lunch", "dinner"],
    "ingredient": ["chickpeas", "spinach", "salmon", "mushrooms", "tofu", "sweet potatoes"],
    "language": ["Spanish", "Japanese", "German", "Portuguese", "Korean"],
    "n": ["3", "5", "7", "10"],
}

# Documents are built from sentence templates; the `key` sentences are what the answer must quote.
SERVICES = ["checkout-api", "search-indexer", "auth-gateway", "billing-worker", "media-transcoder"]
TEAMS = ["Platform", "Payments", "Search", "Identity", "Media"]
PEOPLE = ["Ana Ruiz", "Ben Okafor", "Chen Wei", "Dana Levi", "Emil Novak", "Farah Haddad", "Grace Kim"]
DOC_FILLER = [
    "At {t1} UTC the on-call engineer for {team} received a page for elevated error rates on {svc}.",
    "The dashboard showed p99 latency rising from {a} ms to {b} ms over roughly {m} minutes.",
    "Customers in the {region} region reported failed requests through the support channel.",
    "{p1} joined the incident bridge and took the role of incident commander.",
    "{p2} checked recent deploys and found that version {ver} of {svc} had rolled out an hour earlier.",
    "Traffic was at about {rps} requests per second, which is normal for this time of day.",
    "The team first suspected the database, but its CPU usage stayed below {pct} percent throughout.",
    "Logs from {svc} contained repeated connection timeout messages to the cache cluster.",
    "A status page update was posted at {t2} UTC to tell customers the issue was being investigated.",
    "Error rates dropped back to baseline about {m2} minutes after mitigation began.",
    "No data was lost, but roughly {n} requests failed during the window.",
    "The incident was declared resolved at {t3} UTC after one hour of stable metrics.",
    "{p3} noted that a similar alert fired two weeks ago and auto-resolved before anyone looked at it.",
    "The load balancer health checks kept passing because they do not exercise the cache path.",
    "Several retries from clients amplified the load while the cache was unavailable.",
    "The first responder restarted two {svc} pods, which helped for a few minutes before errors returned.",
    "Memory usage on the cache nodes was flat, which ruled out an eviction storm early on.",
    "{p2} compared the configuration of the old and new versions line by line.",
    "The deploy pipeline had marked version {ver} as healthy because its canary received little traffic.",
    "Support received {tickets} tickets during the incident, most of them about timeouts at checkout.",
    "The rollback took {m2} minutes because the pipeline required a manual approval step.",
    "Internal dashboards for the {team} team were also affected, which slowed the diagnosis.",
    "An alert on cache connection saturation existed, but it was routed to a channel nobody watches.",
    "The incident commander asked for hourly updates until the follow-up actions are complete.",
    "A customer-facing summary was published the next morning.",
]
DOC_KEYS = [
    "The root cause was a configuration change in version {ver} that reduced the cache connection pool "
    "from {pool} to {pool2} connections.",
    "Mitigation was to roll {svc} back to the previous version, which restored the original pool size.",
    "Follow-up action one: add a health check that exercises the cache path, owned by {p1}.",
    "Follow-up action two: require review from the {team} team for changes to connection pool settings.",
    "Follow-up action three: add client-side retry budgets so retries cannot amplify an outage.",
]
REGIONS = ["eu-west", "us-east", "ap-south", "sa-east"]
DOC_TASKS = [
    "Summarize the incident report below for an executive audience. First quote, word for word, the "
    "sentences that state the root cause, the mitigation and every follow-up action; then add a "
    "two-sentence summary.",
    "Read the postmortem below. Copy verbatim every sentence that describes the root cause or a "
    "follow-up action, as a bulleted list, then explain in one paragraph why the alert was missed.",
    "Extract the key facts from this report. Quote the exact sentences about the root cause, mitigation "
    "and follow-up actions, keeping the original wording, then list the people involved.",
]


def _fill(template: str, rng: random.Random, extra: dict[str, str] | None = None) -> str:
    values = {k: rng.choice(v) for k, v in FILL.items()}
    values.update(extra or {})
    return template.format(**values)


def _length(rng: random.Random, *, median: float, sigma: float, low: int, high: int) -> int:
    return max(low, min(high, int(round(math.exp(rng.gauss(math.log(median), sigma))))))


def chat_entry(rng: random.Random, ident: str, *, median: float = 140, high: int = 320) -> dict[str, Any]:
    question = _fill(rng.choice(QUESTIONS), rng)
    return {
        "id": ident,
        "category": "interactive",
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "output_len": _length(rng, median=median, sigma=0.45, low=32, high=high),
    }


def document(rng: random.Random, *, sentences: int) -> tuple[str, list[str]]:
    values = {
        "svc": rng.choice(SERVICES), "team": rng.choice(TEAMS), "region": rng.choice(REGIONS),
        "p1": rng.choice(PEOPLE), "p2": rng.choice(PEOPLE), "p3": rng.choice(PEOPLE),
        "t1": f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}", "t2": f"{rng.randint(0, 23):02d}:15",
        "t3": f"{rng.randint(0, 23):02d}:40", "a": str(rng.randint(80, 200)), "b": str(rng.randint(900, 4000)),
        "m": str(rng.randint(5, 30)), "m2": str(rng.randint(3, 15)), "ver": f"{rng.randint(1, 9)}.{rng.randint(0, 40)}",
        "rps": str(rng.randint(2, 40) * 100), "pct": str(rng.randint(20, 60)), "n": str(rng.randint(1, 90) * 1000),
        "pool": str(rng.choice([64, 128, 256])), "pool2": str(rng.choice([4, 8, 16])),
        "tickets": str(rng.randint(12, 300)),
    }
    keys = [k.format(**values) for k in DOC_KEYS]
    # Distinct sentences, in the (roughly chronological) order of DOC_FILLER.
    picks = sorted(rng.sample(range(len(DOC_FILLER)), min(sentences, len(DOC_FILLER))))
    body = [DOC_FILLER[i].format(**values) for i in picks]
    # The key sentences sit at random places in the body, as they would in a real write-up.
    for key in keys:
        body.insert(rng.randint(0, len(body)), key)
    title = f"Postmortem: {values['svc']} degradation in {values['region']}"
    paragraphs = [" ".join(body[i : i + 5]) for i in range(0, len(body), 5)]
    return title + "\n\n" + "\n\n".join(paragraphs), keys


def summarize_entry(rng: random.Random, ident: str, *, sentences: int = 25, high: int = 384) -> dict[str, Any]:
    text, keys = document(rng, sentences=sentences)
    task = rng.choice(DOC_TASKS)
    return {
        "id": ident,
        "category": "batch",
        "messages": [{"role": "user", "content": f"{task}\n\n---\n{text}\n---"}],
        "output_len": _length(rng, median=256, sigma=0.3, low=128, high=high),
        "reference": " ".join(keys),
    }


def _mixed_entry(rng: random.Random, ident: str) -> dict[str, Any]:
    if rng.random() < 0.7:
        return chat_entry(rng, ident, median=90, high=600)
    entry = summarize_entry(rng, ident, sentences=rng.randint(8, 24), high=600)
    return entry | {"output_len": _length(rng, median=320, sigma=0.5, low=96, high=600)}


SIZES = {"chat": 300, "summarize": 100, "mixed": 300}


def build(name: str) -> list[dict[str, Any]]:
    """`SIZES[name]` entries with pairwise distinct prompts (repeats would hit a server's prefix cache)."""
    makers: dict[str, Callable[[random.Random, str], dict[str, Any]]] = {
        "chat": chat_entry, "summarize": summarize_entry, "mixed": _mixed_entry,
    }
    rng = random.Random(f"decodeservice-{name}")
    entries: list[dict[str, Any]] = []
    seen: set[str] = set()
    while len(entries) < SIZES[name]:
        entry = makers[name](rng, f"{name}-{len(entries):04d}")
        key = json.dumps(entry["messages"])
        if key not in seen:
            seen.add(key)
            entries.append(entry)
    return entries


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=DATASET_DIR)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for name in ("chat", "summarize", "mixed"):
        lines = [json.dumps(entry, ensure_ascii=False) for entry in build(name)]
        (args.out / f"{name}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
        print(f"wrote {args.out / f'{name}.jsonl'} ({len(lines)} entries)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
