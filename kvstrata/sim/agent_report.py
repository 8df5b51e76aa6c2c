"""`kvstrata simulate --workload agentic`: build the agent sessions, run the infinite cache
(which measures the live sessions' working set), size each rank's L1 as a fraction of it,
run lru and session at that memory, and report per run the tokens served per tier, tokens
recomputed and the TTFT of resumed turns by pause length, against issue 34's targets."""

from __future__ import annotations

import gc
import json
import math
import sys
import time
from dataclasses import asdict, dataclass

from kvstrata.sim.agent_run import AgentSim, RunSpec, RunStats
from kvstrata.sim.agent_sessions import PAUSE_BUCKETS, AgentWorkload, pause_bucket
from kvstrata.sim.agent_trace import build_agent_workload
from kvstrata.sim.cache import CachePolicy
from kvstrata.sim.config import SimConfig
from kvstrata.sim.stats import percentile

SERVED_TARGET = 0.95  # tokens served from a tier >= 95% of the infinite cache's
P99_TARGET = 0.5  # p99 TTFT of resumed turns <= 0.5x LRU's with the same memory


@dataclass(frozen=True)
class BucketTtft:
    """TTFT of the resumed turns whose pause fell in one bucket."""

    bucket: str
    num_turns: int
    p50_s: float
    p99_s: float


@dataclass(frozen=True)
class AgentResult:
    """One run. Token counts are prompt tokens over every turn; a resumed turn is any
    turn after a session's first (its TTFT counts the wait for the prefill lane)."""

    name: str
    l1_tokens_per_rank: int
    l2_tokens_per_rank: int
    num_turns: int
    num_dropped_turns: int
    prompt_tokens: int
    served_tokens_l1: int
    served_tokens_l2: int
    served_tokens_l3: int
    computed_tokens: int
    recomputed_tokens: int  # computed on the rank before, evicted since
    stranded_tokens: int  # held by L1 or L2 past a prompt's first missing page
    num_resumed_turns: int
    resumed_ttft_p50_s: float
    resumed_ttft_p99_s: float
    resumed_wait_p99_s: float  # of which queued (for the prefill lane or for L1 pages)
    buckets: tuple[BucketTtft, ...]
    demoted_pages_l1: int  # retained pages copied to L2 on eviction instead of dropped
    evicted_pages_l1: int
    evicted_pages_l2: int
    working_set_tokens_mean: float  # per rank, mean over turn arrivals
    sim_end_s: float
    wall_s: float

    @property
    def served_tokens(self) -> int:
        return self.served_tokens_l1 + self.served_tokens_l2 + self.served_tokens_l3

    def rate(self, num_tokens: int) -> float:
        return num_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @classmethod
    def of(cls, stats: RunStats, spec: RunSpec, config: SimConfig, wall_s: float) -> AgentResult:
        page_size = config.page_size
        turns = stats.turns
        resumed = [r for r in turns if r.idle_s is not None]
        buckets = []
        for label, _ in PAUSE_BUCKETS:
            ttfts = [r.ttft_s for r in resumed if pause_bucket(r.idle_s or 0.0) == label]
            buckets.append(
                BucketTtft(label, len(ttfts), percentile(ttfts, 50), percentile(ttfts, 99))
            )
        counters = stats.cache_counters
        resumed_ttfts = [r.ttft_s for r in resumed]
        return cls(
            name=spec.name,
            l1_tokens_per_rank=spec.num_l1_pages * page_size,
            l2_tokens_per_rank=spec.num_l2_pages * page_size,
            num_turns=len(turns),
            num_dropped_turns=stats.num_dropped_turns,
            prompt_tokens=sum(r.prompt_len for r in turns),
            served_tokens_l1=sum(r.l1_len for r in turns),
            served_tokens_l2=sum(r.l2_len for r in turns),
            served_tokens_l3=sum(r.l3_len for r in turns),
            computed_tokens=sum(r.computed_len for r in turns),
            recomputed_tokens=sum(r.recomputed_len for r in turns),
            stranded_tokens=sum(r.stranded_len for r in turns),
            num_resumed_turns=len(resumed),
            resumed_ttft_p50_s=percentile(resumed_ttfts, 50),
            resumed_ttft_p99_s=percentile(resumed_ttfts, 99),
            resumed_wait_p99_s=percentile([r.wait_s for r in resumed], 99),
            buckets=tuple(buckets),
            demoted_pages_l1=int(counters.get("hicache_demoted_pages_l1", 0)),
            evicted_pages_l1=int(counters.get("hicache_evicted_pages_l1", 0)),
            evicted_pages_l2=int(counters.get("hicache_evicted_pages_l2", 0)),
            working_set_tokens_mean=stats.working_set_pages_mean * page_size,
            sim_end_s=stats.end_s,
            wall_s=wall_s,
        )


@dataclass(frozen=True)
class AgentComparison:
    workload: str
    num_sessions: int
    num_root_sessions: int
    num_requests: int
    results: tuple[AgentResult, ...]
    l1_note: str  # how each rank's L1 was sized

    def result(self, name: str) -> AgentResult | None:
        return next((r for r in self.results if r.name == name), None)

    def served_vs_infinite(self, name: str) -> float | None:
        """Tokens `name` served from a tier as a fraction of the infinite cache's."""
        run, infinite = self.result(name), self.result("infinite")
        if run is None or infinite is None or not infinite.served_tokens:
            return None
        return run.served_tokens / infinite.served_tokens

    def p99_vs_lru(self, name: str) -> float | None:
        """p99 TTFT of `name`'s resumed turns as a multiple of LRU's."""
        run, lru = self.result(name), self.result("lru")
        if run is None or lru is None or not lru.resumed_ttft_p99_s:
            return None
        return run.resumed_ttft_p99_s / lru.resumed_ttft_p99_s


def compare_policies(config: SimConfig, workload: AgentWorkload | None = None) -> AgentComparison:
    """Every run of --cache-policies over the workload, the infinite one first (it sizes
    the others' L1 when --agentic-l1-fraction is set)."""
    workload = workload or build_agent_workload(config, config.seed)
    page_size = config.page_size
    names = sorted(config.cache_run_names, key=lambda n: n != "infinite")
    l1_pages = config.l1_tokens_per_rank // page_size
    l1_note = f"--l1-tokens-per-rank {l1_pages * page_size}"
    results = []
    for name in names:
        if name == "infinite":
            num_pages = workload.distinct_tokens_bound() // page_size + 2 * workload.num_requests
            spec = RunSpec(name, CachePolicy(), num_pages + 1, 0)
        else:
            eviction = "priority" if name == "session" else "lru"
            sessions = config.session_options if name == "session" else None
            policy = CachePolicy(
                eviction, config.agentic_write_policy, sessions, config.agentic_l2_inclusion
            )
            spec = RunSpec(name, policy, l1_pages, int(l1_pages * config.l2_ratio))
        start_s = time.perf_counter()
        stats = AgentSim(config, workload, spec).run()
        results.append(AgentResult.of(stats, spec, config, time.perf_counter() - start_s))
        gc.collect()  # the run's radix trees are cycles (see sim/report.py)
        if name == "infinite" and config.agentic_l1_fraction:
            l1_pages, l1_note = _sized_l1(config, stats)
    return AgentComparison(
        workload.name,
        len(workload.sessions),
        len(workload.roots),
        workload.num_requests,
        tuple(results),
        l1_note,
    )


def _sized_l1(config: SimConfig, infinite: RunStats) -> tuple[int, str]:
    """L1 pages per rank: the fraction of the live sessions' mean working set, raised to
    fit the longest request if it is smaller (said in the note)."""
    fraction = config.agentic_l1_fraction
    l1_pages = math.ceil(fraction * infinite.working_set_pages_mean)
    longest_len = max((r.prompt_len for r in infinite.turns), default=0)
    longest_pages = -(-(longest_len + 2 * config.agentic_output_len) // config.page_size)
    note = (
        f"{fraction:g} x the live sessions' working set per rank, mean at arrivals "
        f"({infinite.working_set_pages_mean * config.page_size:,.0f} tokens; "
        f"max {infinite.working_set_pages_max * config.page_size:,})"
    )
    if l1_pages < longest_pages:
        note += f", raised to fit the longest request ({longest_len:,} tokens)"
        l1_pages = longest_pages
    return l1_pages, note


def print_comparison(config: SimConfig, comparison: AgentComparison) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 200)
    title = (
        f"{comparison.workload}: {comparison.num_root_sessions} root sessions "
        f"({comparison.num_sessions} with sub-agents), {comparison.num_requests} turns, "
        f"{config.num_decode} rank(s); L1 = {comparison.l1_note}; L2 = {config.l2_ratio:g} x "
        f"L1 ({config.agentic_write_policy})"
    )
    table = Table(title=title)
    header: tuple[str, ...] = ("run", "L1 tok", "L2 tok", "served", "L1", "L2", "L3")
    header += ("recomputed tok", "stranded tok", "vs infinite", "resumed", "p50", "p99")
    header += ("p99 vs lru",)
    header += ("wait p99", "demoted pg")
    for column in header:
        table.add_column(column, justify="left" if column == "run" else "right")
    for r in comparison.results:
        served_ratio = comparison.served_vs_infinite(r.name)
        p99_ratio = comparison.p99_vs_lru(r.name)
        table.add_row(
            r.name,
            f"{r.l1_tokens_per_rank:,}",
            f"{r.l2_tokens_per_rank:,}",
            _pct(r.rate(r.served_tokens)),
            _pct(r.rate(r.served_tokens_l1)),
            _pct(r.rate(r.served_tokens_l2)),
            _pct(r.rate(r.served_tokens_l3)),
            f"{r.recomputed_tokens:,}",
            f"{r.stranded_tokens:,}",
            _pct(served_ratio) if served_ratio is not None else "-",
            str(r.num_resumed_turns),
            _s(r.resumed_ttft_p50_s),
            _s(r.resumed_ttft_p99_s),
            f"{p99_ratio:.2f}x" if p99_ratio is not None else "-",
            _s(r.resumed_wait_p99_s),
            f"{r.demoted_pages_l1:,}",
        )
    console.print(table)
    buckets = Table(title="TTFT of resumed turns by pause length: n, p50 / p99")
    buckets.add_column("pause", justify="left")
    for r in comparison.results:
        buckets.add_column(r.name, justify="right")
    for index, (label, _) in enumerate(PAUSE_BUCKETS):
        cells = [
            f"{b.num_turns}: {_s(b.p50_s)} / {_s(b.p99_s)}"
            for b in (r.buckets[index] for r in comparison.results)
        ]
        buckets.add_row(label, *cells)
    console.print(buckets)
    for line in target_lines(comparison):
        console.print(line)


def target_lines(comparison: AgentComparison) -> list[str]:
    """The issue's two targets for the session run, met or not, with the numbers."""
    served, p99 = comparison.served_vs_infinite("session"), comparison.p99_vs_lru("session")
    lines = []
    if served is not None:
        verdict = "met" if served >= SERVED_TARGET else "NOT met"
        lines.append(
            f"target served >= {SERVED_TARGET:.0%} of infinite: session {served:.1%} ({verdict})"
        )
    if p99 is not None:
        verdict = "met" if p99 <= P99_TARGET else "NOT met"
        lines.append(f"target resumed p99 <= {P99_TARGET}x lru: session {p99:.2f}x ({verdict})")
    return lines


def run_agentic(config: SimConfig) -> int:
    comparison = compare_policies(config)
    print_comparison(config, comparison)
    if config.json_out:
        with open(config.json_out, "w") as f:
            json.dump({"config": asdict(config), "comparison": asdict(comparison)}, f, indent=2)
    return 0


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _s(x: float) -> str:
    return f"{x:.3f}s"
