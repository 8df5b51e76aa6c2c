"""One `kvstrata bench` run end to end: probe the server, pick the backend, build the
workload (conversations, or agent sessions), run it under a live progress bar, and
aggregate a `BenchReport`; then print it, write its JSON and its charts."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Awaitable, Callable
from datetime import datetime, timezone
from pathlib import Path

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvstrata.bench.agentic import (
    AgentPacing,
    AgentPrompts,
    AgentTokens,
    fit_to_context,
    run_agentic,
)
from kvstrata.bench.client import Backend, probe_server, routed_per_rank
from kvstrata.bench.config import BenchConfig
from kvstrata.bench.report import BenchReport, build_report
from kvstrata.bench.runner import Pacing, RequestResult, RunOutcome, run_workload
from kvstrata.bench.workloads import WORDS, TextRenderer, build_workload, words_text
from kvstrata.config import ConfigError
from kvstrata.sim.agent_trace import build_agent_workload

OnResult = Callable[[RequestResult], None]

MAX_SYNTHETIC_VOCAB = 32000  # keeps synthetic ids inside any real model's vocabulary
_CONNECT_TIMEOUT_S = 10.0


def _text_renderer(config: BenchConfig) -> tuple[TextRenderer, int]:
    """How synthetic tokens become text, and the vocabulary they are drawn from."""
    if not config.model:
        return words_text, len(WORDS)
    from kvstrata.model.tokenizer import Tokenizer

    tokenizer = Tokenizer(config.model)
    return tokenizer.decode, min(tokenizer.vocab_size, MAX_SYNTHETIC_VOCAB)


async def run_bench_async(config: BenchConfig, console: Console | None = None) -> BenchReport:
    """Run `config` against its server. Raises ConfigError for a workload that cannot
    fit the server, httpx.HTTPError if the server cannot be probed."""
    console = console or Console(stderr=True)
    headers = {"authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    timeout = httpx.Timeout(config.request_timeout_s, connect=_CONNECT_TIMEOUT_S)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    async with httpx.AsyncClient(
        base_url=config.url, headers=headers, timeout=timeout, limits=limits
    ) as http:
        server = await probe_server(http)
        text_mode = config.backend == "openai" or (
            config.backend == "auto" and server.kind != "kvstrata"
        )
        if not text_mode and server.kind != "kvstrata":
            raise ConfigError("--backend generate needs a kvstrata server (GET /server_info)")
        render: TextRenderer | None = None
        if text_mode:
            render, vocab_size = _text_renderer(config)
        else:
            vocab_size = min(server.vocab_size or MAX_SYNTHETIC_VOCAB, MAX_SYNTHETIC_VOCAB)
        if config.vocab_size:
            vocab_size = config.vocab_size
        model_name = config.served_model_name or server.model_name
        backend = Backend(http, text_mode, model_name, config.ignore_eos, config.request_timeout_s)
        run: Callable[[OnResult], Awaitable[RunOutcome]]
        if config.workload == "agentic":
            workload_name, num_requests, run = _agentic_run(
                config, backend, render, vocab_size, server.max_seq_len, console
            )
        else:
            workload = build_workload(config, vocab_size, server.max_seq_len)
            pacing = Pacing(
                config.request_rate,
                config.arrival,
                config.max_concurrency,
                config.round_barrier,
                config.seed,
            )
            workload_name, num_requests = workload.name, workload.num_requests

            def run(on_result: OnResult) -> Awaitable[RunOutcome]:
                return run_workload(
                    workload, backend, pacing, render, config.max_duration_s, on_result
                )

        routed_before = await routed_per_rank(http) if server.is_router else {}
        date = datetime.now(timezone.utc).isoformat(timespec="seconds")
        outcome = await _run_with_progress(config, num_requests, console, run)
        routed_after = await routed_per_rank(http) if server.is_router else {}
    routed = {k: v - routed_before.get(k, 0) for k, v in routed_after.items()}
    return build_report(
        outcome.results,
        label=config.name,
        workload=workload_name,
        url=config.url,
        backend="openai" if text_mode else "generate",
        date=date,
        server=dataclasses.asdict(server),
        config={k: v for k, v in dataclasses.asdict(config).items() if k != "api_key"},
        duration_s=outcome.duration_s,
        timed_out=outcome.timed_out,
        num_requests=num_requests,
        num_ranks=server.num_decode_ranks,
        routed=routed,
        keep_output_ids=config.record_output_ids,
    )


def _agentic_run(
    config: BenchConfig,
    backend: Backend,
    render: TextRenderer | None,
    vocab_size: int,
    max_seq_len: int | None,
    console: Console,
) -> tuple[str, int, Callable[[OnResult], Awaitable[RunOutcome]]]:
    """The agent sessions of --agentic-* (or --agentic-trace), cut to the server's
    context: the workload's name, its request count, and how to run it."""
    workload = build_agent_workload(config, config.seed)
    if max_seq_len is not None:
        workload, num_cut = fit_to_context(workload, max_seq_len)
        if num_cut:
            console.print(
                f"{num_cut} turns cut: their prompt and answer pass the server's context of "
                f"{max_seq_len} tokens (each session ends at its last turn that fits)"
            )
    prompts = AgentPrompts(AgentTokens(workload, vocab_size, config.seed), render)
    pacing = AgentPacing(config.max_concurrency, config.agentic_time_scale, config.max_duration_s)

    def run(on_result: OnResult) -> Awaitable[RunOutcome]:
        return run_agentic(workload, backend, prompts, pacing, on_result)

    return workload.name, workload.num_requests, run


async def _run_with_progress(
    config: BenchConfig,
    num_requests: int,
    console: Console,
    run: Callable[[OnResult], Awaitable[RunOutcome]],
) -> RunOutcome:
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[status]}"),
    )
    with Progress(*columns, console=console, disable=not config.progress) as progress:
        task = progress.add_task(config.name, total=num_requests, status="")
        ttfts: list[float] = []
        failed = 0

        def on_result(result: RequestResult) -> None:
            nonlocal failed
            if result.completion.ttft_s is not None and result.completion.ok:
                ttfts.append(result.completion.ttft_s)
            failed += not result.completion.ok
            mean_ms = 1e3 * sum(ttfts) / len(ttfts) if ttfts else 0.0
            status = f"TTFT mean {mean_ms:.0f} ms" + (f", {failed} failed" if failed else "")
            progress.update(task, advance=1, status=status)

        return await run(on_result)


def run_bench(config: BenchConfig, console: Console | None = None) -> BenchReport:
    return asyncio.run(run_bench_async(config, console))


def save_report(report: BenchReport, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report.to_json(), indent=1) + "\n")


def load_report(path: str | Path) -> BenchReport:
    return BenchReport.from_json(json.loads(Path(path).read_text()))


def bench_main(config: BenchConfig) -> int:
    """`kvstrata bench`: run, print the table, write the JSON and charts. Exit status 1
    if any request failed or the run hit its time bound."""
    from kvstrata.bench.tables import make_console, print_report

    console = make_console()
    try:
        report = run_bench(config, make_console(stderr=True))
    except httpx.HTTPError as e:
        raise ConfigError(f"cannot reach {config.url}: {e}") from e
    print_report(report, console)
    if config.output:
        save_report(report, config.output)
        console.print(f"wrote {config.output}")
    if config.plot:
        try:
            from kvstrata.bench.plots import write_charts

            for path in write_charts([report], config.plot):
                console.print(f"wrote {path}")
        except ImportError:
            console.print(
                "matplotlib is not installed: no charts (kvstrata bench compare "
                "--plot DIR draws them from the JSON elsewhere)"
            )
    return 1 if report.num_failed or report.timed_out else 0
