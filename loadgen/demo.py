"""`decodectl demo`: the engine (bundled model) behind the proxy, a `mixed` workload with speculative
decoding off and on in interleaved rounds, and a side-by-side table with the verdict and its spread.

Steps: pull the model (rich progress); start an engine without speculation and one with it (n-gram, the
engine's defaults: adaptive, step costs measured at start-up), one after the other so neither's start-up
measurement sees the other load, each behind its own proxy on free ports; then in each round send the
same fresh `mixed` requests through one proxy and then the other, the order alternating round by round,
so the machine's other work falls on both alike. The verdict is the median round's ratio of output
tokens/s, with the rounds' min-max. Speculative acceptance comes from the engine's `vllm:spec_decode_*`
counters, read before and after the rounds; why speculation drafted as much as it did, from those and
the engine's /v1/models card (from what acceptance a draft pays at each batch size, measured at start-up).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.table import Table

from decodeservice.loadgen import report
from decodeservice.loadgen.dataset import MaxTokens, load_dataset, plan_requests
from decodeservice.loadgen.errors import BenchConfigError, DemoError
from decodeservice.loadgen.load import LoadLevel, run_level
from decodeservice.loadgen.metrics import LevelSummary, RequestRecord, Slo, summarize
from decodeservice.loadgen.procs import ChildServer, decodectl, free_port
from decodeservice.loadgen.report import BenchReport
from decodeservice.loadgen.runner import resolve_model
from decodeservice.loadgen.spec_verdict import Comparison, SpecActivity, pooled
from decodeservice.monitoring.demo_view import DemoView

SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens")
# A chat user on a small CPU box: the answer starts within 5 s and streams at 2+ chunks/s.
DEFAULT_SLO = Slo(ttft_ms=5000, itl_ms=500)


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    out: Path
    # 6 rounds of 8: the verdict of one run of 8 requests flipped from run to run (x0.74 to x1.08); the
    # median of interleaved rounds, with its spread, holds.
    num_requests: int = 8  # per round, for each of off and on
    rounds: int = 6
    max_tokens: int = 48  # cap on each `mixed` entry's output_len, so the demo stays short on a laptop
    concurrency: int = 4
    model: str = "smollm2-135m"
    num_speculative_tokens: int = 8
    slo: Slo = DEFAULT_SLO
    ready_timeout_s: float = 240.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 1 or self.max_tokens < 1 or self.concurrency < 1 or self.rounds < 1:
            raise BenchConfigError("--num-requests, --rounds, --max-tokens and concurrency must be >= 1")

    @classmethod
    def quick(cls, out: Path) -> DemoConfig:
        return cls(out=out, num_requests=4, rounds=2, max_tokens=24, concurrency=2)


@dataclass(frozen=True, kw_only=True)
class SpecCounters:
    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted_tokens: float = 0.0

    def __sub__(self, other: SpecCounters) -> SpecCounters:
        return SpecCounters(drafts=self.drafts - other.drafts, draft_tokens=self.draft_tokens - other.draft_tokens,
                            accepted_tokens=self.accepted_tokens - other.accepted_tokens)

    def describe(self) -> str:
        """Acceptance rate and mean acceptance length (accepted per draft, plus the bonus/fixed token)."""
        if self.draft_tokens <= 0:
            return "off"
        rate = self.accepted_tokens / self.draft_tokens
        length = 1 + self.accepted_tokens / self.drafts if self.drafts else 0.0
        return f"{rate:.0%} of {self.draft_tokens:.0f} drafted, {length:.2f} tok/step"


def parse_spec_counters(text: str) -> SpecCounters:
    """Sum the `vllm:spec_decode_*` counters in a Prometheus text page (with or without `_total`)."""
    totals = dict.fromkeys(SPEC_COUNTERS, 0.0)
    for family in text_string_to_metric_families(text):
        if family.name in totals:
            totals[family.name] += sum(s.value for s in family.samples if s.name in (family.name, f"{family.name}_total"))
    return SpecCounters(drafts=totals[SPEC_COUNTERS[0]], draft_tokens=totals[SPEC_COUNTERS[1]],
                        accepted_tokens=totals[SPEC_COUNTERS[2]])


async def scrape_spec(url: str) -> SpecCounters:
    async with httpx.AsyncClient(timeout=httpx.Timeout(10.0)) as client:
        response = await client.get(f"{url}/metrics")
    if response.status_code != 200:
        raise DemoError(f"GET {url}/metrics answered HTTP {response.status_code}")
    return parse_spec_counters(response.text)


@dataclass(kw_only=True)
class Demo:
    """Owns the child servers; `close()` stops them all (call it in `finally`)."""

    config: DemoConfig
    console: Console
    children: list[ChildServer] = field(default_factory=list)
    pids: list[int] = field(default_factory=list)
    view: DemoView = field(default_factory=DemoView)  # its own Prometheus, drawn to dashboard.png at the end

    def _start(self, child: ChildServer, what: str) -> ChildServer:
        self.children.append(child)  # tracked before it exists: a Ctrl-C right after Popen still stops it
        child.start()
        assert child.pid is not None
        self.pids.append(child.pid)
        self.console.print(f"started {child.name} (pid {child.pid}) on {child.url}")
        begun = time.monotonic()
        with self.console.status(f"{what}...") as status:

            def tick() -> None:
                status.update(f"{what}... {time.monotonic() - begun:.0f}s  [dim]{child.last_line()}[/]")

            asyncio.run(child.wait_ready(timeout_s=self.config.ready_timeout_s, on_tick=tick))
        self.console.print(f"{child.name} ready after {time.monotonic() - begun:.1f}s")
        return child

    def close(self) -> None:
        self.view.close()
        for child in reversed(self.children):
            child.stop()
        self.children.clear()

    def pull_model(self) -> None:
        self.console.print(f"fetching {self.config.model} (cached after the first run)")
        # Its progress and the path it prints are diagnostics: keep stdout for the results table.
        result = subprocess.run(decodectl("models", "pull", self.config.model), stdout=sys.stderr, check=False)
        if result.returncode != 0:
            raise DemoError(f"`decodectl models pull {self.config.model}` failed with exit code {result.returncode}")

    def run(self) -> tuple[BenchReport, Sequence[Path]]:
        cfg = self.config
        logs = cfg.out / "logs"
        policy = cfg.out / "policy.yaml"
        cfg.out.mkdir(parents=True, exist_ok=True)
        policy.write_text("{}\n")  # the proxy's defaults; see proxy/policy.py
        self.pull_model()
        spec_flags = ["--speculative-method", "ngram", "--num-speculative-tokens", str(cfg.num_speculative_tokens)]
        engines: dict[str, str] = {}
        proxies: dict[str, str] = {}
        for mode, extra in (("off", []), ("on", spec_flags)):
            engine_url, proxy_url = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
            argv = decodectl("engine", "--model", cfg.model, "--host", "127.0.0.1", "--port", engine_url.rsplit(":", 1)[1],
                             "--max-num-seqs", str(max(8, cfg.concurrency)), *extra)
            self._start(ChildServer(name=f"engine (speculation {mode})", argv=argv, url=engine_url,
                                    log_path=logs / f"engine-{mode}.log"), f"loading {cfg.model} into the engine (speculation {mode})")
            self._start(ChildServer(name=f"proxy (speculation {mode})", url=proxy_url, log_path=logs / f"proxy-{mode}.log",
                                    argv=decodectl("proxy", "--upstream", engine_url, "--host", "127.0.0.1", "--port",
                                                   proxy_url.rsplit(":", 1)[1], "--policy", str(policy))), f"starting the proxy ({mode})")
            engines[mode], proxies[mode] = engine_url, proxy_url
        # The dashboard draws both pairs as two services, spec-off and spec-on, side by side in each panel.
        self.view.watch(services={f"spec-{mode}": url for mode, url in proxies.items()}, out=cfg.out,
                        console=self.console)
        model = asyncio.run(resolve_model(proxies["on"], None))
        plan = plan_requests(load_dataset("mixed"), num_levels=cfg.rounds + 1, num_requests=cfg.num_requests,
                             seed=cfg.seed, max_tokens=MaxTokens(kind="dataset", cap=cfg.max_tokens))
        level = LoadLevel(kind="concurrency", value=cfg.concurrency)
        warm_up, rounds = plan.levels[0][: cfg.concurrency], plan.levels[1:]
        for mode in ("off", "on"):  # the first requests of a process pay for allocator growth and caches
            asyncio.run(run_level(url=proxies[mode], model=model, requests=warm_up, level=level))
        before = asyncio.run(scrape_spec(engines["on"]))
        card = asyncio.run(speculative_card(engines["on"]))
        records: dict[str, list[RequestRecord]] = {"off": [], "on": []}
        per_round: dict[str, list[LevelSummary]] = {"off": [], "on": []}
        ratios: list[float] = []
        self.console.print(f"[bold]{cfg.rounds} rounds[/] of {cfg.num_requests} `mixed` requests at concurrency "
                           f"{cfg.concurrency} (max {cfg.max_tokens} tokens) through each proxy, off and on in turn")
        for index, requests in enumerate(rounds):
            order = ("off", "on") if index % 2 == 0 else ("on", "off")
            for mode in order:
                got = asyncio.run(run_level(url=proxies[mode], model=model, requests=requests, level=level,
                                            seed=cfg.seed * 1_000_003 + index))
                records[mode].extend(got)
                per_round[mode].append(summarize(got, label=f"round {index + 1} {mode}", slo=cfg.slo))
            off, on = per_round["off"][-1].output_throughput, per_round["on"][-1].output_throughput
            ratios.append(on / off if off > 0 else 0.0)
            self.console.print(f"round {index + 1}/{cfg.rounds}: off {off:.1f}, on {on:.1f} output tok/s (x{ratios[-1]:.2f})")
        counters = asyncio.run(scrape_spec(engines["on"])) - before
        summaries = [pooled(f"speculation {mode} c={cfg.concurrency}", per_round[mode], records[mode], slo=cfg.slo)
                     for mode in ("off", "on")]
        comparison = Comparison(ratios=tuple(ratios))
        activity = SpecActivity(drafts=counters.drafts, draft_tokens=counters.draft_tokens,
                                accepted_tokens=counters.accepted_tokens, output_tokens=summaries[1].total_output_tokens,
                                concurrency=cfg.concurrency, disable_batch_size=card.get("disable_batch_size"),
                                break_even={int(b): float(a) for b, a in card.get("break_even_acceptance", {}).items()})
        settings = {"engines": f"{cfg.model}: off {engines['off']}, on {engines['on']} (both running throughout)",
                    "proxies": f"off {proxies['off']}, on {proxies['on']}", "model": model, "dataset": "mixed",
                    "rounds": f"{cfg.rounds} x {cfg.num_requests} requests, concurrency {cfg.concurrency}, order alternating",
                    "max_tokens": f"dataset:{cfg.max_tokens}", "slo": cfg.slo.describe(),
                    "request options": "stream, include_usage, ignore_eos, temperature=0",
                    "speculation": f"ngram, k<={cfg.num_speculative_tokens}, adaptive",
                    "pids": " ".join(map(str, self.pids))}
        final = BenchReport(title="decodectl demo: speculative decoding off vs on", settings=settings,
                            levels=tuple(summaries),
                            extra_columns={"spec acceptance": ("off", counters.describe()),
                                           "on/off per round": ("", f"x{comparison.median:.2f} ({comparison.spread})")},
                            notes=(comparison.verdict, activity.reason(),
                                   "Per-round on/off output tok/s: " + ", ".join(f"{r:.2f}" for r in ratios),
                                   "Each round sends the same fresh prompts to both engines (no prompt repeats "
                                   "across rounds, so neither sees the other's prefix cache)."))
        return final, [*report.write(final, cfg.out), *self.view.draw()]


async def speculative_card(url: str) -> dict[str, Any]:
    """The `speculative` part of an engine's /v1/models card ({} when it has none)."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(10.0)) as client:
        response = await client.get(f"{url}/v1/models")
    if response.status_code != 200:
        raise DemoError(f"GET {url}/v1/models answered HTTP {response.status_code}")
    data = response.json().get("data") or [{}]
    card = data[0].get("speculative")
    return card if isinstance(card, dict) else {}


def side_by_side(result: BenchReport) -> Table:
    """Metrics as rows, runs as columns: TTFT and ITL apart, throughput, goodput and acceptance."""
    table = Table(title=result.title, caption=f"goodput SLO: {result.levels[0].slo if result.levels else '-'}")
    table.add_column("metric")
    for level in result.levels:
        table.add_column(level.label.rsplit(" c=", 1)[0], justify="right")

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.0f} ms"

    rows: list[tuple[str, list[str]]] = [
        ("TTFT p50 / p99", [f"{ms(lv.ttft.p50)} / {ms(lv.ttft.p99)}" for lv in result.levels]),
        ("ITL p50 / p99", [f"{ms(lv.itl.p50)} / {ms(lv.itl.p99)}" for lv in result.levels]),
        ("TPOT p50", [ms(lv.tpot.p50) for lv in result.levels]),
        ("E2E p50", [ms(lv.e2e.p50) for lv in result.levels]),
        ("output tok/s", [f"{lv.output_throughput:.1f}" for lv in result.levels]),
        ("requests/s", [f"{lv.request_throughput:.2f}" for lv in result.levels]),
        ("completed", [f"{lv.completed}/{lv.num_requests}" for lv in result.levels]),
        ("goodput", [f"{lv.goodput_fraction or 0:.0%}" for lv in result.levels]),
        ("spec acceptance", list(result.extra_columns.get("spec acceptance", ()))),
        ("on/off, median (rounds)", list(result.extra_columns.get("on/off per round", ()))),
    ]
    for name, cells in rows:
        table.add_row(name, *cells)
    return table
