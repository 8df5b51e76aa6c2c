"""`kvstrata bench compare A.json B.json ...`: several saved runs side by side (deltas
against the first), optionally as charts and as a markdown table."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kvstrata.bench.run import load_report
from kvstrata.bench.tables import make_console, markdown_comparison, print_comparison
from kvstrata.config import ConfigError


def compare_main(paths: Sequence[str], plot_dir: str = "", markdown: str = "") -> int:
    if not paths:
        raise ConfigError("kvstrata bench compare needs at least one results JSON")
    reports = []
    for path in paths:
        try:
            reports.append(load_report(path))
        except (OSError, ValueError, TypeError) as e:
            raise ConfigError(f"{path}: not a kvstrata bench results file ({e})") from e
    console = make_console()
    print_comparison(reports, console)
    if markdown:
        Path(markdown).write_text(markdown_comparison(reports))
        console.print(f"wrote {markdown}")
    if plot_dir:
        try:
            from kvstrata.bench.plots import write_charts

            for path in write_charts(reports, plot_dir):
                console.print(f"wrote {path}")
        except ImportError:
            console.print("matplotlib is not installed: no charts (pip install matplotlib)")
    return 0
