"""The lanes of benchmarks/served_vs_peers.py: a server over HTTP, or the engine in a child process
(`python -P served_lanes.py`, fed batches of messages on stdin), each timed by the same clocks."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx

from decodeservice.loadgen.client import BenchRequest, send
from decodeservice.loadgen.metrics import RequestRecord
from decodeservice.loadgen.procs import ChildServer

if TYPE_CHECKING:  # the parent process stays without torch
    from decodeservice.engine import Engine

MODEL = "smollm2-135m"
TTFT_METRIC = "vllm:time_to_first_token_seconds"


# -- the clocks -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Timed:
    ttft: float
    decode: float  # tokens/s after the first
    tokens: int
    start: float
    end: float


def timed(record: RequestRecord) -> Timed:
    if not record.ok or record.ttft is None:
        raise RuntimeError(f"a request failed: {record.error}")
    first = record.chunk_times[0]
    return Timed(ttft=record.ttft, decode=(record.output_tokens - 1) / max(record.end - first, 1e-9),
                 tokens=record.output_tokens, start=record.start, end=record.end)


async def settle(*, busy_below: float = 0.15, window_s: float = 0.2, limit_s: float = 15.0) -> float:
    """Wait until the CPUs are idle (under `busy_below` busy over a `window_s` window, from /proc/stat), so
    a lane does not pay for the one before it: vLLM's engine keeps a core busy for about a second after
    its last request. Returns the seconds waited (`limit_s` at most)."""
    def busy_total() -> tuple[int, int]:
        with open("/proc/stat") as stat:
            ticks = [int(x) for x in stat.readline().split()[1:]]
        return sum(ticks) - ticks[3] - ticks[4], sum(ticks)  # less idle and iowait

    begun = time.perf_counter()
    while time.perf_counter() - begun < limit_s:
        before = busy_total()
        await asyncio.sleep(window_s)
        after = busy_total()
        if after[0] - before[0] < busy_below * max(after[1] - before[1], 1):
            break
    return time.perf_counter() - begun


# -- lanes ------------------------------------------------------------------------------------------
class HttpLane:
    def __init__(self, name: str, server: ChildServer, ready_path: str) -> None:
        self.name, self.server, self.ready_path = name, server, ready_path
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(600.0),
                                        limits=httpx.Limits(max_connections=64, max_keepalive_connections=64))

    async def start(self, timeout_s: float) -> None:
        self.server.start()
        await self.server.wait_ready(timeout_s=timeout_s, path=self.ready_path)

    async def run(self, requests: list[BenchRequest]) -> list[Timed]:
        records = await asyncio.gather(*(send(self.client, url=self.server.url, model=MODEL, request=r)
                                         for r in requests))
        return [timed(r) for r in records]

    async def server_ttft(self) -> tuple[float, float] | None:
        """The server's own TTFT histogram (sum, count), `vllm:time_to_first_token_seconds` on /metrics:
        vLLM's, and ours under the same name, both timed from the request's arrival at the engine front."""
        response = await self.client.get(f"{self.server.url}/metrics", timeout=30.0)
        if response.status_code != 200:
            return None
        totals = {"_sum": 0.0, "_count": 0.0}
        for line in response.text.splitlines():
            if line.startswith(TTFT_METRIC):
                name, _, value = line.rpartition(" ")
                for suffix in totals:
                    if name.startswith(TTFT_METRIC + suffix):
                        totals[suffix] += float(value)
        return (totals["_sum"], totals["_count"]) if totals["_count"] else None

    async def stop(self) -> None:
        await self.client.aclose()
        self.server.stop()


class InProcessLane:
    """The engine in a child process (this file, run as a script), fed the same messages over a pipe."""

    name = "in_process"

    def __init__(self) -> None:
        self.proc: subprocess.Popen[str] | None = None
        self.info: dict[str, Any] = {}

    async def start(self, timeout_s: float) -> None:
        self.proc = subprocess.Popen([sys.executable, "-P", __file__], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.info = await asyncio.to_thread(self._read)

    def _read(self) -> Any:
        assert self.proc is not None and self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the in-process child exited")
        return json.loads(line)

    async def run(self, requests: list[BenchRequest]) -> list[Timed]:
        assert self.proc is not None and self.proc.stdin is not None
        batch = [{"messages": [{"role": r, "content": c} for r, c in req.messages or ()],
                  "max_tokens": req.max_tokens} for req in requests]
        self.proc.stdin.write(json.dumps(batch) + "\n")
        self.proc.stdin.flush()
        return [Timed(**t) for t in await asyncio.to_thread(self._read)]

    async def server_ttft(self) -> tuple[float, float] | None:
        return None  # no server: its TTFT is all engine

    async def stop(self) -> None:
        if self.proc is not None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


def add_chat(engine: Engine, messages: list[dict[str, str]], *, max_tokens: int) -> str:
    """A chat request as the server takes it (its template, no special tokens added again), greedy and
    `ignore_eos` as every lane asks; its request id."""
    from decodeservice.engine import SamplingParams

    text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return engine.add_request(engine.encode_prompt(text, add_special_tokens=False),
                              SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


def child() -> int:
    """Serve batches from stdin: add them all at once, step to the end, report each one's clocks.

    One thread of its own builds the engine and steps it, as the server's engine loop does
    (`AsyncEngine.launch`): a second thread that had run torch's parallel regions (the loader's, here
    the main thread's) keeps an OpenMP pool alive, and libgomp then throttles its spin-wait at every
    barrier (benchmarks/step_thread_layout.py)."""
    import queue
    import threading

    import torch

    from decodeservice.engine import Engine

    def run_batch(engine: Engine, batch: list[dict[str, Any]]) -> list[dict[str, float]]:
        start: dict[str, float] = {}
        first: dict[str, float] = {}
        tokens: dict[str, int] = {}
        for item in batch:
            start_s = time.perf_counter()
            start[add_chat(engine, item["messages"], max_tokens=item["max_tokens"])] = start_s
        end: dict[str, float] = {}
        while engine.has_unfinished_requests():
            outs = engine.step()
            now = time.perf_counter()
            for out in outs:
                if out.new_text and out.request_id not in first:
                    first[out.request_id] = now  # as the client sees it: the first chunk with text
                if out.finished:
                    end[out.request_id], tokens[out.request_id] = now, out.num_output_tokens
        return [{"ttft": first[r] - start[r], "decode": (tokens[r] - 1) / max(end[r] - first[r], 1e-9),
                 "tokens": tokens[r], "start": start[r], "end": end[r]} for r in start]

    batches: queue.SimpleQueue[list[dict[str, Any]] | None] = queue.SimpleQueue()

    def loop() -> None:
        engine = Engine.from_pretrained(MODEL)  # the defaults `decodectl engine` serves with
        plan = engine.model.kernel_plan.describe() if engine.model.kernel_plan is not None else {}
        print(json.dumps({"torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
                          "torch_threads": torch.get_num_threads(), "weights": engine.model.weight_format,
                          "activations": str(engine.dtype).removeprefix("torch."),
                          "prompt_copy_bytes": plan.get("prompt_copy_bytes"),
                          "kernel_rows": plan.get("rows"),
                          "steps_on": "the thread that built it, as the server's engine loop"}), flush=True)
        while (batch := batches.get()) is not None:
            print(json.dumps(run_batch(engine, batch)), flush=True)

    worker = threading.Thread(target=loop, name="engine-steps")
    worker.start()
    for line in sys.stdin:
        batches.put(json.loads(line))
    batches.put(None)
    worker.join()
    return 0


if __name__ == "__main__":
    sys.exit(child())
