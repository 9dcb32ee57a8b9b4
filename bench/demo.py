"""`decodectl demo`: the engine (bundled model) behind the proxy, a short `mixed` workload with speculative
decoding off and then on, and a side-by-side table.

Steps: pull the model (rich progress), start the engine and the proxy on free ports, run the workload
through the proxy, restart the engine with `--speculative-method ngram` on the same port (the proxy's
/ready follows it), run the same requests again, then compare. Speculative acceptance comes from the
engine's `vllm:spec_decode_*` counters, read before and after each run. Both runs send the same prompts
to a freshly started engine, so neither sees the other's prefix cache.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.table import Table

from decodeservice.bench import report
from decodeservice.bench.dataset import MaxTokens
from decodeservice.bench.errors import BenchConfigError, DemoError
from decodeservice.bench.load import LoadLevel
from decodeservice.bench.metrics import LevelSummary, Slo
from decodeservice.bench.procs import ChildServer, decodectl, free_port
from decodeservice.bench.report import BenchReport
from decodeservice.bench.runner import BenchConfig, run_benchmark
from decodeservice.monitoring.demo_view import DemoView

SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens")
# A chat user on a small CPU box: the answer starts within 5 s and streams at 2+ chunks/s.
DEFAULT_SLO = Slo(ttft_ms=5000, itl_ms=500)


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    out: Path
    num_requests: int = 8
    max_tokens: int = 48  # cap on each `mixed` entry's output_len, so the demo stays short on a laptop
    concurrency: int = 4  # below the engine's speculation cut-off (8 running sequences)
    model: str = "smollm2-135m"
    num_speculative_tokens: int = 8
    slo: Slo = DEFAULT_SLO
    ready_timeout_s: float = 240.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 1 or self.max_tokens < 1 or self.concurrency < 1:
            raise BenchConfigError("--num-requests, --max-tokens and concurrency must be >= 1")

    @classmethod
    def quick(cls, out: Path) -> DemoConfig:
        return cls(out=out, num_requests=4, max_tokens=24, concurrency=2)


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

    def _stop(self, child: ChildServer) -> None:
        child.stop()
        self.children.remove(child)

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
        engine_port, proxy_port = free_port(), free_port()
        engine_url, proxy_url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{proxy_port}"
        base = decodectl("engine", "--model", cfg.model, "--host", "127.0.0.1", "--port", str(engine_port),
                         "--max-num-seqs", str(max(8, cfg.concurrency)))
        spec_flags = ["--speculative-method", "ngram", "--num-speculative-tokens", str(cfg.num_speculative_tokens)]
        bench = BenchConfig(url=proxy_url, dataset="mixed", levels=(LoadLevel(kind="concurrency", value=cfg.concurrency),),
                            num_requests=cfg.num_requests, max_tokens=MaxTokens(kind="dataset", cap=cfg.max_tokens),
                            slo=cfg.slo, seed=cfg.seed)
        summaries: list[LevelSummary] = []
        acceptance: list[str] = []
        proxy: ChildServer | None = None
        for mode, extra in (("speculation off", []), ("speculation on", spec_flags)):
            engine = self._start(ChildServer(name=f"engine ({mode})", argv=[*base, *extra], url=engine_url,
                                             log_path=logs / f"engine-{mode.split()[-1]}.log"),
                                 f"loading {cfg.model} into the engine ({mode})")
            if proxy is None:
                proxy = self._start(ChildServer(name="proxy", url=proxy_url, log_path=logs / "proxy.log", argv=decodectl(
                    "proxy", "--upstream", engine_url, "--host", "127.0.0.1", "--port", str(proxy_port),
                    "--policy", str(policy))), "starting the proxy")
                self.view.watch(proxy_url=proxy_url, out=cfg.out, console=self.console)
            else:  # the proxy's /ready follows the restarted upstream
                asyncio.run(proxy.wait_ready(timeout_s=cfg.ready_timeout_s))
            before = asyncio.run(scrape_spec(engine_url))
            self.console.print(f"[bold]{mode}[/]: {cfg.num_requests} `mixed` requests at concurrency "
                               f"{cfg.concurrency}, max {cfg.max_tokens} tokens, through the proxy")
            result = asyncio.run(run_benchmark(replace(bench, label_prefix=f"{mode} "), console=self.console))
            acceptance.append((asyncio.run(scrape_spec(engine_url)) - before).describe())
            summaries.extend(result.levels)
            settings = result.settings
            self._stop(engine)
        settings = {**settings, "engine": f"{cfg.model} on {engine_url} (restarted per run)",
                    "proxy": proxy_url, "speculation": f"ngram, k={cfg.num_speculative_tokens}",
                    "pids": " ".join(map(str, self.pids))}
        final = BenchReport(title="decodectl demo: speculative decoding off vs on", settings=settings,
                            levels=tuple(summaries), extra_columns={"spec acceptance": tuple(acceptance)},
                            notes=("Both runs send the same prompts to a freshly started engine (no shared "
                                   "prefix cache).",))
        return final, [*report.write(final, cfg.out), *self.view.draw()]


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
    ]
    for name, cells in rows:
        table.add_row(name, *cells)
    return table
