"""Rich tables of benchmark reports: one run in detail (`print_report`) and several runs
side by side with deltas against the first (`print_comparison`)."""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

from kvstrata.bench.report import BenchReport, TierSummary


def make_console(stderr: bool = False) -> Console:
    """A console as wide as the terminal, or 200 columns when output is not a terminal
    (a log file), so the wide comparison tables stay readable."""
    console = Console(stderr=stderr)
    return console if console.is_terminal else Console(stderr=stderr, width=200)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def _pct(fraction: float) -> str:
    return f"{fraction:.1%}"


def delta(value: float, baseline: float) -> str:
    """Relative change against the baseline, e.g. '-39.3%' ('' when undefined)."""
    if baseline == 0:
        return ""
    return f"{(value - baseline) / baseline:+.1%}"


def _server_line(report: BenchReport) -> str:
    server = report.server
    if server.get("is_router"):
        method = server.get("load_balance_method") or "?"
        where = f"router over {server.get('num_decode_ranks')} decode ranks ({method})"
    else:
        where = "one kvstrata rank" if server.get("kind") == "kvstrata" else "OpenAI-compatible"
    return f"{server.get('model_name') or '?'} at {report.url}: {where}"


def print_report(report: BenchReport, console: Console) -> None:
    console.print(
        f"[bold]{report.label}[/bold]: {report.workload} via {report.backend}, "
        f"{_server_line(report)}; {report.num_ok} of {report.num_requests} requests ok "
        f"({report.num_failed} failed{', run hit --max-duration-s' if report.timed_out else ''}"
        f") in {report.duration_s:.1f} s"
    )
    latency = Table(title="latency (ms)")
    for column in ("metric", "mean", "p50", "p90", "p99", "max", "n"):
        latency.add_column(column, justify="left" if column == "metric" else "right")
    for name, stats in (
        ("TTFT", report.ttft_s),
        ("TPOT", report.tpot_s),
        ("ITL", report.itl_s),
        ("E2E", report.e2e_s),
    ):
        latency.add_row(
            name,
            *(_ms(getattr(stats, k)) for k in ("mean", "p50", "p90", "p99", "max")),
            str(stats.n),
        )
    console.print(latency)
    console.print(
        f"throughput: {report.request_throughput_per_s:.2f} req/s, "
        f"{report.input_token_throughput_per_s:.0f} prompt tok/s, "
        f"{report.output_token_throughput_per_s:.0f} output tok/s"
    )
    console.print(_tier_table(report.tiers))
    if report.pauses:  # agent sessions: by pause length rather than by turn
        console.print(_pause_table(report))
    elif len(report.rounds) > 1:
        console.print(_round_table(report))
    if len(report.ranks) > 1:
        console.print(_rank_table(report))
    for error in report.errors:
        console.print(f"[red]error[/red]: {error}")


def _tier_table(tiers: TierSummary) -> Table:
    table = Table(title=f"prompt tokens by source (of {tiers.prompt_tokens})")
    for column in ("L1 hit", "L2 hit", "L3 hit", "hit (all)", "transferred", "computed"):
        table.add_column(column, justify="right")
    table.add_row(
        *(
            f"{n} ({_pct(r)})"
            for n, r in (
                (tiers.cached_tokens_l1, tiers.hit_rate_l1),
                (tiers.cached_tokens_l2, tiers.hit_rate_l2),
                (tiers.cached_tokens_l3, tiers.hit_rate_l3),
                (tiers.cached_tokens, tiers.hit_rate),
                (tiers.transferred_tokens, tiers.transferred_rate),
            )
        ),
        str(tiers.computed_tokens),
    )
    return table


def _round_table(report: BenchReport) -> Table:
    table = Table(title="per round")
    for column in (
        "round",
        "requests",
        "mean prompt",
        "TTFT mean ms",
        "p90",
        "p99",
        "hit",
        "L1",
        "L2",
        "L3",
    ):
        table.add_column(column, justify="right")
    for r in report.rounds:
        t = r.tiers
        table.add_row(
            str(r.round),
            str(r.num_requests),
            f"{r.mean_prompt_tokens:.0f}",
            _ms(r.ttft_s.mean),
            _ms(r.ttft_s.p90),
            _ms(r.ttft_s.p99),
            *_hit_cells(t),
        )
    return table


def _hit_cells(tiers: TierSummary) -> list[str]:
    """Hit rate in all, then per tier (L1, L2, L3)."""
    return [
        _pct(rate)
        for rate in (tiers.hit_rate, tiers.hit_rate_l1, tiers.hit_rate_l2, tiers.hit_rate_l3)
    ]


def _pause_table(report: BenchReport) -> Table:
    table = Table(title="resumed agent turns by the pause before them")
    for column in ("pause", "requests", "TTFT p50 ms", "p99", "hit", "L1", "L2", "L3"):
        table.add_column(column, justify="left" if column == "pause" else "right")
    for p in report.pauses:
        t = p.tiers
        table.add_row(
            p.bucket,
            str(p.num_requests),
            _ms(p.ttft_s.p50),
            _ms(p.ttft_s.p99),
            *_hit_cells(t),
        )
    return table


def _rank_table(report: BenchReport) -> Table:
    table = Table(
        title=f"per decode rank (imbalance: requests {report.load_imbalance:.2f}, "
        f"prompt tokens {report.token_imbalance:.2f})"
    )
    for column in ("rank", "requests", "prompt tokens", "routed by router"):
        table.add_column(column, justify="right")
    for rank in report.ranks:
        routed = "-" if rank.num_routed is None else str(rank.num_routed)
        table.add_row(str(rank.rank), str(rank.num_requests), str(rank.prompt_tokens), routed)
    return table


COMPARISON_COLUMNS = (
    "run",
    "TTFT mean ms",
    "Δ",
    "TTFT p90 ms",
    "Δ",
    "TTFT p99 ms",
    "Δ",
    "TPOT mean ms",
    "Δ",
    "hit",
    "L1",
    "L2",
    "L3",
    "transferred",
    "imbalance",
    "tok imbalance",
    "req/s",
    "ok",
)


def _with_delta(value_s: float, base_s: float, show_delta: bool) -> list[str]:
    return [_ms(value_s), delta(value_s, base_s) if show_delta else ""]


def comparison_rows(reports: Sequence[BenchReport]) -> list[list[str]]:
    """One row per report (COMPARISON_COLUMNS); deltas are against the first report."""
    base = reports[0]
    rows = []
    for index, report in enumerate(reports):
        ttft, tpot, t = report.ttft_s, report.tpot_s, report.tiers
        rows.append(
            [
                report.label,
                *_with_delta(ttft.mean, base.ttft_s.mean, index > 0),
                *_with_delta(ttft.p90, base.ttft_s.p90, index > 0),
                *_with_delta(ttft.p99, base.ttft_s.p99, index > 0),
                *_with_delta(tpot.mean, base.tpot_s.mean, index > 0),
                *_hit_cells(t),
                _pct(t.transferred_rate),
                f"{report.load_imbalance:.2f}",
                f"{report.token_imbalance:.2f}",
                f"{report.request_throughput_per_s:.2f}",
                f"{report.num_ok}/{report.num_requests}",
            ]
        )
    return rows


def print_comparison(reports: Sequence[BenchReport], console: Console, title: str = "") -> None:
    table = Table(title=title or f"{len(reports)} runs (Δ against {reports[0].label})")
    for column in COMPARISON_COLUMNS:
        table.add_column(
            column, justify="left" if column == "run" else "right", no_wrap=column == "run"
        )
    for row in comparison_rows(reports):
        table.add_row(*row)
    console.print(table)
    rounds = max(len(r.rounds) for r in reports)
    if rounds > 1:
        per_round = Table(title="TTFT mean ms per round")
        per_round.add_column("run")
        for index in range(1, rounds + 1):
            per_round.add_column(f"round {index}", justify="right")
        for report in reports:
            by_round = {r.round: _ms(r.ttft_s.mean) for r in report.rounds}
            per_round.add_row(report.label, *(by_round.get(i, "-") for i in range(1, rounds + 1)))
        console.print(per_round)


def markdown_comparison(reports: Sequence[BenchReport]) -> str:
    """The comparison as a markdown table (for docs/results.md)."""
    lines = ["| " + " | ".join(COMPARISON_COLUMNS) + " |", "|" + "---|" * len(COMPARISON_COLUMNS)]
    lines += ["| " + " | ".join(row) + " |" for row in comparison_rows(reports)]
    return "\n".join(lines) + "\n"
