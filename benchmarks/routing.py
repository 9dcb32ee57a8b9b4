"""Fleet routing on real engines: `decodectl router` against round-robin and pure prefix affinity.

    .venv/bin/python -P benchmarks/routing.py --rounds 2 --out benchmarks/results/routing.json

Two replicas, each `decodectl engine` (one torch thread) behind its own `decodectl proxy`, plus one
`decodectl router` over the two proxies, all on loopback. The workload: `--conversations`
multi-turn chats, `--concurrency` at a time, each opening with a shared system prompt and its own
document of about `--doc-tokens` tokens, then `--turns` questions, each sent with the whole history
(the assistant's real answers included). The same client sends every policy's requests:

- `router`: to the router, which picks the replica (docs/routing.md);
- `round_robin`: to the replicas in turn, request by request (what a Service does, near enough);
- `affinity`: to the replica a hash of the conversation's opening picks (pure prefix affinity).

One long conversation opening per replica warms the engines first (not recorded). Each (round,
policy) run gets its own system prompt and documents, so no run finds another's prefixes
cached; the policies run interleaved, rotating the order each round, so each sees the same machine
load on average. Reported per policy, over every request of every round: TTFT p50/p95 measured by the
client (send to first content token), the share of prompt tokens the engines served from their
prefix cache (`usage.prompt_tokens_details.cached_tokens` over `usage.prompt_tokens`), and requests
lost (anything but a complete 200 stream once the client's retries are spent: like the `openai` client
it retries a 429 or 503 after its `Retry-After`, `--retries` times; TTFT then counts from the first
send, waits included, and the refusals are reported too). The targets: router cached share >= 0.9x affinity's, TTFT
p50 <= 0.5x round-robin's, p95 <= 0.8x round-robin's, nothing lost. JSON to stdout and `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import itertools
import json
import os
import platform
import random
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx

from decodeservice.common.stats import percentile
from decodeservice.loadgen.procs import ChildServer, decodectl, free_port

sys.path.insert(0, str(Path(__file__).parent))  # `python -P` leaves the script's folder off the path
from json_out import emit

POLICIES = ("router", "round_robin", "affinity")
_WORDS = ("cache routing replica prefix token latency queue engine proxy block model request stream "
          "service fleet policy tenant scale zero pod cluster memory kernel batch decode prefill tail "
          "median percentile objective admission shed hold window metric scrape endpoint slice hash "
          "river mountain garden window letter market harbour station bridge forest island valley "
          "winter summer morning evening question answer number reason history science music story").split()
QUESTIONS = ("Summarise the document in one sentence.", "Which word appears most often?",
             "Name three words from the second half.", "What would you call this document?",
             "Give one more detail.", "Is anything repeated?")


def document(rng: random.Random, tokens: int) -> str:
    # About one token a word for these words with SmolLM2's tokenizer (the engines' usage counts say so).
    words = [rng.choice(_WORDS) for _ in range(tokens)]
    return " ".join(words)


def conversations(run: str, *, n: int, doc_tokens: int, seed: int) -> list[list[dict[str, str]]]:
    """Each conversation's opening messages: the run's shared system prompt, then its own document."""
    rng = random.Random(f"{seed}-{run}")
    system = (f"Session {run}. You are a careful assistant. Answer questions about the document the user "
              "gives you, briefly and precisely, quoting it where you can. ") * 2
    return [[{"role": "system", "content": system},
             {"role": "user", "content": f"Document {i}:\n{document(rng, doc_tokens)}\n\n{QUESTIONS[0]}"}]
            for i in range(n)]


async def stream_chat(client: httpx.AsyncClient, url: str, messages: list[dict[str, str]], *,
                      max_tokens: int, retries: int) -> dict[str, Any]:
    """One streamed chat request: its TTFT (from the first attempt's send), answer and usage; `ok` only
    for a complete 200 stream. A 429 or 503 is retried after its `Retry-After` up to `retries` times,
    as the `openai` client does by default (two retries)."""
    sent = time.perf_counter()
    shed = 0
    while True:
        out = await _attempt(client, url, messages, max_tokens=max_tokens, sent=sent)
        if out.get("status") not in (429, 503) or shed >= retries:
            return out | {"refused": shed}
        shed += 1
        await asyncio.sleep(float(out.get("retry_after") or 1))


async def _attempt(client: httpx.AsyncClient, url: str, messages: list[dict[str, str]], *, max_tokens: int,
                   sent: float) -> dict[str, Any]:
    body = {"model": "smollm2-135m", "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    out: dict[str, Any] = {"ok": False, "ttft": None, "text": "", "prompt_tokens": 0, "cached_tokens": 0}
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
            out["status"] = response.status_code
            if response.status_code != 200:
                await response.aread()
                out["retry_after"] = response.headers.get("retry-after")
                return out
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    out["ok"] = True
                    break
                event = json.loads(line[6:])
                for choice in event.get("choices") or ():
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        if out["ttft"] is None:
                            out["ttft"] = time.perf_counter() - sent
                        out["text"] += content
                usage = event.get("usage")
                if usage:
                    out["prompt_tokens"] = usage.get("prompt_tokens", 0)
                    out["cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    except httpx.HTTPError as exc:
        out["error"] = type(exc).__name__
    return out


async def run_policy(pick: Callable[[int, list[dict[str, str]]], str], openings: list[list[dict[str, str]]], *,
                     turns: int, concurrency: int, max_tokens: int, retries: int) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    todo = list(enumerate(openings))
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0)) as client:
        async def worker() -> None:
            while todo:
                conv, messages = todo.pop(0)
                messages = list(messages)
                for turn in range(turns):
                    result = await stream_chat(client, pick(conv, messages), messages, max_tokens=max_tokens,
                                               retries=retries)
                    records.append({"conversation": conv, "turn": turn, **{k: v for k, v in result.items()
                                                                           if k not in ("text", "retry_after")}})
                    messages += [{"role": "assistant", "content": result["text"] or "(no answer)"},
                                 {"role": "user", "content": QUESTIONS[(turn + 1) % len(QUESTIONS)]}]

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return records


def summarise(records: list[dict[str, Any]], *, concurrency: int) -> dict[str, Any]:
    ttfts = [r["ttft"] for r in records if r["ok"] and r["ttft"] is not None]
    # Each run opens `concurrency` cold conversations at once, two per replica or more, in every policy
    # alike: what their first turns take is the stacked prefill no routing avoids (a diagnostic beside
    # the target, which stays over every request).
    later = [r["ttft"] for r in records if r["ok"] and r["ttft"] is not None
             and not (r["turn"] == 0 and r["conversation"] < concurrency)]
    openings = [r["ttft"] for r in records if r["ok"] and r["ttft"] is not None
                and r["turn"] == 0 and r["conversation"] < concurrency]
    prompt = sum(r["prompt_tokens"] for r in records if r["ok"])
    cached = sum(r["cached_tokens"] for r in records if r["ok"])
    return {"requests": len(records), "lost": sum(1 for r in records if not r["ok"]),
            "refusals_retried": sum(r["refused"] for r in records),
            "ttft_p50_s": round(percentile(ttfts, 50), 4) if ttfts else None,
            "ttft_p95_s": round(percentile(ttfts, 95), 4) if ttfts else None,
            "ttft_mean_s": round(sum(ttfts) / len(ttfts), 4) if ttfts else None,
            "ttft_simultaneous_openings_s": sorted(round(t, 3) for t in openings),
            "ttft_p95_s_after_openings": round(percentile(later, 95), 4) if later else None,
            "prompt_tokens": prompt, "cached_tokens": cached,
            "cached_share": round(cached / prompt, 4) if prompt else None}


def p95_floor(*, lone_s: float, concurrency: int, replicas: int, requests_per_run: int, runs: int) -> float:
    """The TTFT p95 no policy can beat on this workload: every run opens `concurrency` cold conversations at
    once on `replicas` one-engine replicas, so, spread as evenly as can be, a replica takes up to
    ceil(concurrency / replicas) of them and its k-th finishes its prefill no earlier than k x a lone
    opening's TTFT (work conservation: a step's 512-token budget already fills the GEMMs, so two prompts
    together take no less than one after the other). Every other request's floor is 0. Where the stacked
    openings are more than 5% of the requests, they set p95 for every policy alike."""
    per_replica = [concurrency // replicas + (1 if j < concurrency % replicas else 0) for j in range(replicas)]
    stacked = [k * lone_s for n in per_replica for k in range(1, n + 1)]
    floors = (stacked + [0.0] * (requests_per_run - len(stacked))) * runs
    return percentile(floors, 95)


@contextlib.asynccontextmanager
async def fleet(args: argparse.Namespace, logs: Path) -> AsyncIterator[tuple[list[str], str]]:
    """Two engine + proxy replicas and a router over them: the proxies' URLs and the router's."""
    children: list[ChildServer] = []
    try:
        engines, proxies = [], []
        for i in range(args.replicas):
            port = free_port()
            engine = ChildServer(name=f"engine{i}", url=f"http://127.0.0.1:{port}", log_path=logs / f"engine{i}.log",
                                 argv=decodectl("engine", "--model", args.model, "--port", str(port),
                                                "--num-threads", str(args.threads), "--kv-cache-gib", "1"))
            engine.start()
            children.append(engine)
            engines.append(engine)
        for engine in engines:
            await engine.wait_ready(timeout_s=300)
        policy = logs / "policy.yaml"
        policy.write_text(f"slo: {{ttftMs: {args.ttft_ms}}}\n")
        for i, engine in enumerate(engines):
            port = free_port()
            proxy = ChildServer(name=f"proxy{i}", url=f"http://127.0.0.1:{port}", log_path=logs / f"proxy{i}.log",
                                argv=decodectl("proxy", "--upstream", engine.url, "--port", str(port),
                                               "--policy", str(policy), "--log-level", "warning"))
            proxy.start()
            children.append(proxy)
            proxies.append(proxy)
        for proxy in proxies:
            await proxy.wait_ready(timeout_s=60)
        port = free_port()
        router = ChildServer(name="router", url=f"http://127.0.0.1:{port}", log_path=logs / "router.log",
                             argv=decodectl("router", "--host", "127.0.0.1", "--port", str(port), "--endpoints",
                                            ",".join(p.url for p in proxies), "--policy", str(policy),
                                            "--log-level", "warning"))
        router.start()
        children.append(router)
        await router.wait_ready(timeout_s=60)
        yield [p.url for p in proxies], router.url
    finally:
        for child in reversed(children):
            child.stop()


async def router_decisions(router: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    async with httpx.AsyncClient() as client:
        text = (await client.get(router + "/metrics")).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "decode_router:decisions_total":
                out[s.labels["reason"]] = out.get(s.labels["reason"], 0) + s.value
            elif s.name in ("decode_router:requests_shed_total",) and s.value:
                out[f"shed_{s.labels['reason']}"] = out.get(f"shed_{s.labels['reason']}", 0) + s.value
    return out


async def amain(args: argparse.Namespace) -> dict[str, Any]:
    load_start = [round(x, 2) for x in os.getloadavg()]
    with tempfile.TemporaryDirectory(prefix="routing-") as tmp:
        async with fleet(args, Path(tmp)) as (proxies, router):
            # Warm-up, not recorded: the first long prompt an engine sees runs slower than the rest
            # (allocations, first-use paths), and whichever policy ran first would pay for it.
            warm = conversations("warm-up", n=len(proxies), doc_tokens=args.doc_tokens, seed=args.seed)
            async with httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as client:
                await asyncio.gather(*(stream_chat(client, url, messages, max_tokens=args.max_tokens, retries=0)
                                       for url, messages in zip(proxies, warm, strict=True)))
                # A cold opening alone on each replica, one after the other: the prefill time the floor
                # below stacks.
                lone = []
                for i, url in enumerate(proxies):
                    (messages,) = conversations(f"lone-{i}", n=1, doc_tokens=args.doc_tokens, seed=args.seed)
                    result = await stream_chat(client, url, messages, max_tokens=args.max_tokens, retries=0)
                    lone.append(result["ttft"])
            by_policy: dict[str, list[dict[str, Any]]] = {p: [] for p in POLICIES}
            per_round: list[dict[str, Any]] = []
            for rnd in range(args.rounds):
                order = POLICIES[rnd % 3:] + POLICIES[:rnd % 3]
                for name in order:
                    openings = conversations(f"{rnd}-{name}", n=args.conversations, doc_tokens=args.doc_tokens,
                                             seed=args.seed)
                    turn_counter = itertools.count()

                    def pick(conv: int, messages: list[dict[str, str]], name: str = name,
                             counter: itertools.count[int] = turn_counter) -> str:
                        if name == "router":
                            return router
                        if name == "round_robin":
                            return proxies[next(counter) % len(proxies)]
                        opening = json.dumps(messages[:2]).encode()
                        return proxies[int.from_bytes(hashlib.blake2b(opening, digest_size=8).digest()) % len(proxies)]

                    started = time.perf_counter()
                    records = await run_policy(pick, openings, turns=args.turns, concurrency=args.concurrency,
                                               max_tokens=args.max_tokens, retries=args.retries)
                    by_policy[name] += [r | {"round": rnd} for r in records]
                    per_round.append({"round": rnd, "policy": name, "wall_s": round(time.perf_counter() - started, 2),
                                      **summarise(records, concurrency=args.concurrency)})
                    print(json.dumps(per_round[-1]), flush=True)
            decisions = await router_decisions(router)
    summary = {name: summarise(records, concurrency=args.concurrency) for name, records in by_policy.items()}
    r, rr, aff = summary["router"], summary["round_robin"], summary["affinity"]

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a is not None and b else None

    ratios = {"cached_share_router_over_affinity": ratio(r["cached_share"], aff["cached_share"]),
              "ttft_p50_router_over_round_robin": ratio(r["ttft_p50_s"], rr["ttft_p50_s"]),
              "ttft_p95_router_over_round_robin": ratio(r["ttft_p95_s"], rr["ttft_p95_s"]),
              "ttft_p50_affinity_over_round_robin": ratio(aff["ttft_p50_s"], rr["ttft_p50_s"]),
              "ttft_p95_affinity_over_round_robin": ratio(aff["ttft_p95_s"], rr["ttft_p95_s"]),
              "ttft_p95_after_openings_router_over_round_robin": ratio(r["ttft_p95_s_after_openings"],
                                                                       rr["ttft_p95_s_after_openings"])}
    lone_s = min(t for t in lone if t is not None)
    floor = p95_floor(lone_s=lone_s, concurrency=args.concurrency, replicas=args.replicas,
                      requests_per_run=args.conversations * args.turns, runs=args.rounds)
    ratios["ttft_p95_floor_any_policy_over_round_robin"] = ratio(floor, rr["ttft_p95_s"])
    targets = {"cached_share_ge_0.9x_affinity": (ratios["cached_share_router_over_affinity"] or 0) >= 0.9,
               "ttft_p50_le_0.5x_round_robin": (ratios["ttft_p50_router_over_round_robin"] or 9) <= 0.5,
               "ttft_p95_le_0.8x_round_robin": (ratios["ttft_p95_router_over_round_robin"] or 9) <= 0.8,
               "nothing_lost": r["lost"] == 0}
    return {"study": "routing", "command": "benchmarks/routing.py " + " ".join(args.argv),
            "machine": {"cpu": platform.processor() or platform.machine(), "note": args.note,
                        "load_average_1_5_15_start": load_start,
                        "load_average_1_5_15_end": [round(x, 2) for x in os.getloadavg()]},
            "setup": {"replicas": args.replicas, "threads_per_engine": args.threads, "conversations": args.conversations,
                      "concurrency": args.concurrency, "turns": args.turns, "doc_tokens": args.doc_tokens,
                      "max_tokens": args.max_tokens, "ttft_ms": args.ttft_ms, "rounds": args.rounds},
            "lone_cold_opening_ttft_s": [None if t is None else round(t, 4) for t in lone],
            "ttft_p95_floor_any_policy_s": round(floor, 4),
            "policies": summary, "ratios": ratios, "targets_met": targets, "router_decisions": decisions,
            "per_round": per_round,
            # Every request: [round, conversation, turn, ttft s, prompt tokens, cached tokens, refusals, ok].
            "requests": {name: [[r["round"], r["conversation"], r["turn"], None if r["ttft"] is None
                                 else round(r["ttft"], 4), r["prompt_tokens"], r["cached_tokens"], r["refused"],
                                 r["ok"]] for r in records] for name, records in by_policy.items()}}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per engine")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--doc-tokens", type=int, default=600)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--ttft-ms", type=float, default=1000.0, help="the policy's slo.ttftMs (router and proxies)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--retries", type=int, default=2,
                        help="retries of a 429/503 after its Retry-After (the openai client's default: 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--note", default="", help="free text about the machine's state, stored in the JSON")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]
    result = asyncio.run(amain(args))
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
