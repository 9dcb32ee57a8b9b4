"""One benchmark run: resolve the model, draw the requests, drive each load level, summarize."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from decodeservice.loadgen.client import base_url, list_models
from decodeservice.loadgen.dataset import MaxTokens, load_dataset, plan_requests
from decodeservice.loadgen.errors import BenchConfigError, ServerError
from decodeservice.loadgen.load import LoadLevel, run_level
from decodeservice.loadgen.metrics import LevelSummary, RequestRecord, Slo, summarize
from decodeservice.loadgen.report import BenchReport

PREFIX_CACHE_WARNING = (
    "{n} of {total} requests repeat a prompt already sent in this run: a server with prefix caching "
    "(vLLM, llama.cpp, DecodeService) serves their prefill from cache, so TTFT at later levels looks better "
    "than fresh traffic would. Use a larger dataset or fewer --num-requests, or turn prefix caching off."
)


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    url: str
    dataset: str
    levels: tuple[LoadLevel, ...]
    num_requests: int = 100
    max_tokens: MaxTokens = MaxTokens(kind="fixed", low=256, high=256)
    slo: Slo | None = None
    model: str | None = None
    seed: int = 0
    label_prefix: str = ""

    def __post_init__(self) -> None:
        if not self.levels:
            raise BenchConfigError("give --concurrency or --rate")
        if len({level.kind for level in self.levels}) != 1:
            raise BenchConfigError("a run sweeps concurrency or uses a rate, not both")
        if self.num_requests < 1:
            raise BenchConfigError("--num-requests must be >= 1")


async def resolve_model(url: str, model: str | None) -> str:
    """`model`, or the first listed one; an unreachable server fails here, before any progress bar."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(10.0)) as client:
        try:
            models = await list_models(client, url)
        except ServerError:
            if model is None or not await _reachable(client, url):
                raise
            models = []  # reachable, but no usable /v1/models: the given name is all we need
    if model is not None:
        return model  # servers may serve names they do not list (aliases); let the server decide
    if not models:
        raise ServerError(f"{url}/v1/models lists no model; pass --model")
    return models[0]


async def _reachable(client: httpx.AsyncClient, url: str) -> bool:
    try:
        await client.get(url)
    except httpx.HTTPError:
        return False
    return True


async def run_benchmark(config: BenchConfig, *, console: Console, title: str = "decodectl bench") -> BenchReport:
    """Run every level in order; progress and warnings go to `console` (normally stderr)."""
    url = base_url(config.url)
    entries = load_dataset(config.dataset)
    model = await resolve_model(url, config.model)
    plan = plan_requests(entries, num_levels=len(config.levels), num_requests=config.num_requests,
                         seed=config.seed, max_tokens=config.max_tokens)
    notes = []
    if plan.repeated_prompts:
        message = PREFIX_CACHE_WARNING.format(n=plan.repeated_prompts,
                                              total=len(config.levels) * config.num_requests)
        console.print(f"[bold yellow]warning:[/] {message}")
        notes.append(message)
    summaries: list[LevelSummary] = []
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=False) as progress:
        for index, (level, requests) in enumerate(zip(config.levels, plan.levels, strict=True)):
            label = f"{config.label_prefix}{level.label}"
            task = progress.add_task(f"{label} -> {model}", total=len(requests))

            def advance(_record: RequestRecord, task_id: TaskID = task) -> None:
                progress.advance(task_id)

            records = await run_level(url=url, model=model, requests=requests, level=level,
                                      seed=config.seed * 1_000_003 + index, on_done=advance)
            summary = summarize(records, label=label, slo=config.slo)
            if summary.completed == 0:
                console.print(f"[bold red]error:[/] every request at {label} failed: {'; '.join(summary.errors)}")
            summaries.append(summary)
    settings = {
        "url": url, "model": model, "dataset": config.dataset, "num_requests per level": config.num_requests,
        "load": ", ".join(level.label for level in config.levels), "max_tokens": config.max_tokens.describe(),
        "slo": config.slo.describe() if config.slo else "none", "seed": config.seed,
        "request options": "stream, include_usage, ignore_eos, temperature=0",
    }
    return BenchReport(title=title, settings=settings, levels=tuple(summaries), notes=tuple(notes))


def default_out_dir() -> Path:
    return Path("bench-results")
