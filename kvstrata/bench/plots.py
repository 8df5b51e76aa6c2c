"""PNG charts of one or more benchmark reports (matplotlib, no display needed): TTFT CDF
per run, TTFT per round, prompt tokens by source, and requests per decode rank."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvstrata.bench.report import BenchReport

_DPI = 100
_SOURCES = (  # (label, TierSummary field, colour): the parts add up to the prompt tokens
    ("L1 hit", "cached_tokens_l1", "#1b7837"),
    ("L2 hit", "cached_tokens_l2", "#7fbf7b"),
    ("L3 hit", "cached_tokens_l3", "#d9f0d3"),
    ("transferred", "transferred_tokens", "#9970ab"),
    ("computed", "computed_tokens", "#bbbbbb"),
)


def _figure(width_in: float = 6.4, height_in: float = 4.0) -> tuple[Any, Any]:
    from matplotlib.figure import Figure  # Figure without pyplot renders with Agg

    figure = Figure(figsize=(width_in, height_in), layout="constrained")
    return figure, figure.subplots()


def _save(figure: Any, path: Path) -> Path:
    figure.savefig(path, dpi=_DPI)
    return path


def ttft_cdf(reports: Sequence[BenchReport], path: Path) -> Path:
    figure, ax = _figure()
    for report in reports:
        ttft_ms = np.sort([r.ttft_s * 1e3 for r in report.requests if r.ttft_s is not None])
        if len(ttft_ms):
            ax.step(
                ttft_ms,
                np.arange(1, len(ttft_ms) + 1) / len(ttft_ms),
                where="post",
                label=report.label,
            )
    ax.set(xlabel="TTFT (ms)", ylabel="fraction of requests", title="TTFT CDF", ylim=(0, 1.01))
    ax.grid(alpha=0.3)
    if ax.lines:  # no legend for runs without a successful request
        ax.legend(fontsize="small")
    return _save(figure, path)


def ttft_per_round(reports: Sequence[BenchReport], path: Path) -> Path:
    figure, ax = _figure()
    for index, report in enumerate(reports):
        rounds = [r.round for r in report.rounds]
        colour = f"C{index % 10}"
        ax.plot(
            rounds,
            [r.ttft_s.mean * 1e3 for r in report.rounds],
            "o-",
            color=colour,
            label=f"{report.label} mean",
        )
        ax.plot(
            rounds,
            [r.ttft_s.p99 * 1e3 for r in report.rounds],
            "x--",
            color=colour,
            label=f"{report.label} p99",
        )
    num_rounds = max(len(r.rounds) for r in reports)
    ax.set(
        xlabel="round", ylabel="TTFT (ms)", title="TTFT per round", xticks=range(1, num_rounds + 1)
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize="x-small", ncol=2)
    return _save(figure, path)


def prompt_sources(reports: Sequence[BenchReport], path: Path) -> Path:
    figure, ax = _figure(max(5.5, 1.1 * len(reports) + 3.0))
    # One bar per run at its own x, labelled below: runs that share a label still stand
    # side by side instead of being drawn over each other.
    positions = np.arange(len(reports))
    bottom = np.zeros(len(reports))
    for name, key, colour in _SOURCES:
        share = np.array(
            [
                getattr(r.tiers, key) / r.tiers.prompt_tokens if r.tiers.prompt_tokens else 0.0
                for r in reports
            ]
        )
        ax.bar(positions, share, bottom=bottom, label=name, color=colour, edgecolor="white")
        bottom += share
    ax.set(ylabel="fraction of prompt tokens", title="prompt tokens by source", ylim=(0, 1.0))
    ax.set_xticks(positions, [r.label for r in reports])
    ax.tick_params(axis="x", labelrotation=20, labelsize="small")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _save(figure, path)


def rank_load(reports: Sequence[BenchReport], path: Path) -> Path:
    figure, ax = _figure()
    num_ranks = max(len(r.ranks) for r in reports)
    width = 0.8 / len(reports)
    for index, report in enumerate(reports):
        x = (
            np.array([rank.rank for rank in report.ranks])
            + (index - (len(reports) - 1) / 2) * width
        )
        ax.bar(
            x,
            [rank.num_requests for rank in report.ranks],
            width,
            label=f"{report.label} (imbalance {report.load_imbalance:.2f})",
        )
    ax.set(
        xlabel="decode rank",
        ylabel="requests served",
        title="requests per decode rank",
        xticks=range(num_ranks),
    )
    ax.legend(fontsize="x-small")
    return _save(figure, path)


def write_charts(
    reports: Sequence[BenchReport], out_dir: str | Path, prefix: str = ""
) -> list[Path]:
    """Write every chart that applies into `out_dir`; returns their paths. Raises
    ImportError if matplotlib is not installed."""
    import matplotlib

    matplotlib.use("Agg")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [
        ttft_cdf(reports, out / f"{prefix}ttft_cdf.png"),
        prompt_sources(reports, out / f"{prefix}hit_rate.png"),
    ]
    if any(len(r.rounds) > 1 for r in reports):
        paths.append(ttft_per_round(reports, out / f"{prefix}ttft_per_round.png"))
    if any(len(r.ranks) > 1 for r in reports):
        paths.append(rank_load(reports, out / f"{prefix}rank_load.png"))
    return paths
