"""`kvstrata simulate`: run every requested policy over the trace and report, per policy,
hit rate per tier, estimated TTFT mean/p50/p99 and load imbalance, as a table and JSON
(`--workload agentic` goes to agent_report.py)."""

from __future__ import annotations

import gc
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass

from kvstrata.sim.agent_report import run_agentic
from kvstrata.sim.cluster import ClusterSim, RunStats
from kvstrata.sim.config import SimConfig
from kvstrata.sim.stats import percentile
from kvstrata.sim.trace import load_trace

__all__ = ["PolicyResult", "percentile", "run_simulate", "simulate"]


@dataclass(frozen=True)
class PolicyResult:
    policy: str
    num_requests: int
    num_dropped: int
    hit_rate: float  # cached prompt tokens / prompt tokens
    hit_rate_l1: float
    hit_rate_l2: float
    hit_rate_l3: float
    estimated_hit_rate: float  # what the router expected (digest matches)
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    imbalance_mean: float  # mean over arrivals of max/mean queued requests per rank
    branches: dict[str, int]
    requests_per_rank: list[int]
    wall_s: float  # simulator run time

    @classmethod
    def of(cls, policy: str, stats: RunStats, wall_s: float) -> PolicyResult:
        tokens = max(stats.input_tokens, 1)
        l1, l2, l3 = (n / tokens for n in stats.hit_tokens)
        return cls(
            policy,
            stats.num_requests,
            stats.num_dropped,
            l1 + l2 + l3,
            l1,
            l2,
            l3,
            stats.estimated_matched_tokens / tokens,
            _mean(stats.ttft_s),
            percentile(stats.ttft_s, 50),
            percentile(stats.ttft_s, 99),
            _mean(stats.imbalance) if stats.imbalance else 1.0,
            dict(sorted(stats.branches.items())),
            stats.requests_per_rank,
            wall_s,
        )


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else 0.0


def simulate(config: SimConfig) -> list[PolicyResult]:
    requests = load_trace(config.trace, config.max_requests, config.arrival_speedup)
    results = []
    for policy in config.policies:
        start_s = time.perf_counter()
        stats = ClusterSim(config, policy, requests).run()
        results.append(PolicyResult.of(policy, stats, time.perf_counter() - start_s))
        # The run's caches (radix nodes link parent <-> child) are cycles that only the
        # collector frees; it was off during the run, so without this every run's cluster
        # stays alive until the command exits.
        gc.collect()
    return results


def to_json(config: SimConfig, results: list[PolicyResult]) -> dict[str, object]:
    return {"config": asdict(config), "results": [asdict(r) for r in results]}


def print_table(config: SimConfig, results: list[PolicyResult]) -> None:
    title = (
        f"{config.num_decode} decode ranks, {results[0].num_requests if results else 0} "
        f"requests, {config.trace}"
    )
    header = (
        "policy",
        "hit",
        "L1",
        "L2",
        "L3",
        "est. hit",
        "TTFT mean",
        "p50",
        "p99",
        "imbalance",
        "branches",
    )
    rows = [
        (
            r.policy,
            _pct(r.hit_rate),
            _pct(r.hit_rate_l1),
            _pct(r.hit_rate_l2),
            _pct(r.hit_rate_l3),
            _pct(r.estimated_hit_rate),
            _s(r.ttft_mean_s),
            _s(r.ttft_p50_s),
            _s(r.ttft_p99_s),
            f"{r.imbalance_mean:.2f}",
            " ".join(f"{k}={v}" for k, v in r.branches.items()),
        )
        for r in results
    ]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        for row in (header, *rows):
            print(" | ".join(row))
        return
    table = Table(title=title)
    for name in header:
        table.add_column(name, justify="left" if name in ("policy", "branches") else "right")
    for row in rows:
        table.add_row(*row)
    # Piped output (a file, CI) would otherwise be cut to 80 columns.
    Console(width=None if sys.stdout.isatty() else 160).print(table)


def run_simulate(config: SimConfig) -> int:
    if config.workload == "agentic":
        return run_agentic(config)
    results = simulate(config)
    print_table(config, results)
    if config.json_out:
        with open(config.json_out, "w") as f:
            json.dump(to_json(config, results), f, indent=2)
    return 0


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _s(x: float) -> str:
    return f"{x:.3f} s"
