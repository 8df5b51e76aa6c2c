"""`kvstrata bench compare A.json B.json ...`: several saved runs side by side (deltas
against the first), optionally as charts and as a markdown table. Runs that share a label
are told apart by their files' names or folders."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from kvstrata.bench.report import BenchReport
from kvstrata.bench.run import load_report
from kvstrata.bench.tables import make_console, markdown_comparison, print_comparison
from kvstrata.config import ConfigError

# The comparison's charts carry this prefix, so `--plot` may name the folder that a single
# run's charts (ttft_cdf.png, ...) are in without overwriting them.
CHART_PREFIX = "compare_"


def distinct_labels(labels: Sequence[str], paths: Sequence[str | Path]) -> list[str]:
    """`labels`, except that runs sharing one are named from their paths: the file name
    (without .json) if those differ, else the shortest folder suffix that tells them apart
    (runs/off/mt.json and runs/l1l2l3/mt.json: "off" and "l1l2l3")."""
    counts = Counter(labels)
    names = list(labels)
    for label in (label for label, count in counts.items() if count > 1):
        group = [index for index, other in enumerate(labels) if other == label]
        parts = [Path(paths[index]).resolve().with_suffix("").parts for index in group]
        for depth in range(1, max(len(p) for p in parts) + 1):
            # `depth` trailing parts of each path, the file name dropped past depth 1.
            tails = ["/".join(p[-depth:] if depth == 1 else p[-depth:-1]) for p in parts]
            if len(set(tails)) == len(tails):
                break
        else:
            tails = [f"{label} #{n}" for n in range(1, len(group) + 1)]  # the same file twice
        for index, tail in zip(group, tails, strict=True):
            names[index] = tail
    return names


def load_reports(paths: Sequence[str]) -> list[BenchReport]:
    if not paths:
        raise ConfigError("kvstrata bench compare needs at least one results JSON")
    reports = []
    for path in paths:
        try:
            reports.append(load_report(path))
        except (OSError, ValueError, TypeError) as e:
            raise ConfigError(f"{path}: not a kvstrata bench results file ({e})") from e
    labels = distinct_labels([r.label for r in reports], paths)
    return [dataclasses.replace(r, label=label) for r, label in zip(reports, labels, strict=True)]


def compare_main(paths: Sequence[str], plot_dir: str = "", markdown: str = "") -> int:
    reports = load_reports(paths)
    console = make_console()
    print_comparison(reports, console)
    if markdown:
        Path(markdown).write_text(markdown_comparison(reports))
        console.print(f"wrote {markdown}")
    if plot_dir:
        try:
            from kvstrata.bench.plots import write_charts

            for path in write_charts(reports, plot_dir, prefix=CHART_PREFIX):
                console.print(f"wrote {path}")
        except ImportError:
            console.print("matplotlib is not installed: no charts (pip install matplotlib)")
    return 0
