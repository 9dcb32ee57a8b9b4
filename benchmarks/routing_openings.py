"""Two cold prompts at once on one engine: what `benchmarks/routing.py`'s simultaneous openings cost,
and what a router could change about it by when it sends the second.

    .venv/bin/python -P benchmarks/routing_openings.py --rounds 4 --out benchmarks/results/routing_openings.json

One `decodectl engine` (one torch thread, as in routing.py), no proxy: the question is the engine's
own scheduling. Each prompt is a routing.py conversation opening (the shared system prompt and a
document of `--doc-tokens` words, never seen before by the engine, so nothing of it is cached but
the system prompt). Three ways of serving two openings that reach a replica together, in turns each
round (the order turning, so each sees the machine's load alike):

- `alone`: one opening by itself, its TTFT is the cold prefill `T`;
- `together`: both sent at once (what every policy of routing.py does with its first four
  conversations on two replicas): the engine's chunked prefill spends its step budget on the first
  and gives what is left of a step to the second, so each one's TTFT is read from the common send;
- `held`: the second sent only when the first's first token comes (what a router holding a request
  while every endpoint is mid-prefill would do), its TTFT also counted from the common arrival.

Reported: each mode's TTFTs (first and second to finish), their medians over the rounds, and the
ratios to `T`; the machine's load average. JSON to stdout and `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from decodeservice.loadgen.procs import ChildServer, decodectl, free_port

sys.path.insert(0, str(Path(__file__).resolve().parent))
from json_out import emit
from routing import conversations, stream_chat

MODES = ("alone", "together", "held")


async def first_token(client: httpx.AsyncClient, url: str, messages: list[dict[str, str]], *, max_tokens: int,
                      started: float) -> float:
    """Seconds from `started` to this request's first content token (it is sent now)."""
    sent = time.perf_counter()  # stream_chat counts its TTFT from here (its own send)
    out = await stream_chat(client, url, messages, max_tokens=max_tokens, retries=0)
    if not out["ok"] or out["ttft"] is None:
        raise RuntimeError(f"the engine did not answer: {out}")
    return round(sent - started + out["ttft"], 4)


async def serve_pair(client: httpx.AsyncClient, url: str, mode: str, openings: list[list[dict[str, str]]], *,
                     max_tokens: int) -> list[float]:
    started = time.perf_counter()
    if mode == "alone":
        return [await first_token(client, url, openings[0], max_tokens=max_tokens, started=started)]
    if mode == "together":
        return sorted(await asyncio.gather(*(first_token(client, url, m, max_tokens=max_tokens, started=started)
                                             for m in openings)))
    # held: the second leaves when the first's first token arrives; stream_chat returns after the whole
    # answer, so the first's TTFT is awaited through a stream of its own here.
    first_done = asyncio.Event()

    async def first() -> float:
        body = {"model": "smollm2-135m", "messages": openings[0], "max_tokens": max_tokens, "temperature": 0.0,
                "stream": True}
        ttft = None
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
            async for line in response.aiter_lines():
                if ttft is not None or not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if any((c.get("delta") or {}).get("content") for c in json.loads(line[6:]).get("choices") or ()):
                    ttft = round(time.perf_counter() - started, 4)  # the first content token, as stream_chat
                    first_done.set()
        first_done.set()
        if ttft is None:
            raise RuntimeError("the first opening got no token")
        return ttft

    async def second() -> float:
        await first_done.wait()
        return await first_token(client, url, openings[1], max_tokens=max_tokens, started=started)

    return sorted(await asyncio.gather(first(), second()))


async def amain(args: argparse.Namespace) -> dict[str, Any]:
    load_start = [round(x, 2) for x in os.getloadavg()]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="routing-openings-") as tmp:
        port = free_port()
        engine = ChildServer(name="engine", url=f"http://127.0.0.1:{port}", log_path=Path(tmp) / "engine.log",
                             argv=decodectl("engine", "--model", args.model, "--port", str(port),
                                            "--num-threads", str(args.threads), "--kv-cache-gib", "1"))
        engine.start()
        try:
            await engine.wait_ready(timeout_s=300)
            async with httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as client:
                warm = conversations("warm-up", n=1, doc_tokens=args.doc_tokens, seed=args.seed)
                await stream_chat(client, engine.url, warm[0], max_tokens=args.max_tokens, retries=0)
                for rnd in range(args.rounds):
                    order = MODES[rnd % 3:] + MODES[:rnd % 3]
                    for mode in order:
                        openings = conversations(f"{rnd}-{mode}", n=2, doc_tokens=args.doc_tokens, seed=args.seed)
                        ttfts = await serve_pair(client, engine.url, mode, openings, max_tokens=args.max_tokens)
                        rows.append({"round": rnd, "mode": mode, "ttft_s": ttfts,
                                     "load_average_1m": round(os.getloadavg()[0], 2)})
                        print(json.dumps(rows[-1]), flush=True)
        finally:
            engine.stop()

    def med(mode: str, i: int) -> float:
        return round(statistics.median(r["ttft_s"][i] for r in rows if r["mode"] == mode), 4)

    alone = med("alone", 0)
    summary = {"alone_T_s": alone}
    for mode in ("together", "held"):
        summary[mode] = {"first_s": med(mode, 0), "second_s": med(mode, 1),
                         "first_over_T": round(med(mode, 0) / alone, 3), "second_over_T": round(med(mode, 1) / alone, 3)}
    return {"study": "routing_openings", "command": "benchmarks/routing_openings.py " + " ".join(args.argv),
            "machine": {"cpu": platform.processor() or platform.machine(), "note": args.note,
                        "load_average_1_5_15_start": load_start,
                        "load_average_1_5_15_end": [round(x, 2) for x in os.getloadavg()]},
            "setup": {"threads": args.threads, "doc_tokens": args.doc_tokens, "max_tokens": args.max_tokens,
                      "rounds": args.rounds, "max_num_batched_tokens": "the engine's default"},
            "medians": summary, "rounds": rows}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the engine")
    parser.add_argument("--doc-tokens", type=int, default=600)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=4)
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
