"""`kvstrata bench compare`'s run names: runs sharing a label are named from their files
(names, else folders), the hit-rate chart puts every run at its own x, and the comparison's
charts never overwrite a single run's."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstrata.bench.compare import CHART_PREFIX, distinct_labels
from kvstrata.bench.plots import prompt_sources, write_charts
from kvstrata.bench.report import BenchReport, build_report


def test_distinct_labels_keep_unique_ones_and_name_the_rest_from_their_paths() -> None:
    assert distinct_labels(["a", "b"], ["x/1.json", "x/2.json"]) == ["a", "b"]
    assert distinct_labels(["mt", "mt"], ["runs/off.json", "runs/l1l2l3.json"]) == [
        "off",
        "l1l2l3",
    ]
    assert distinct_labels(
        ["mt", "other", "mt"], ["runs/off/mt.json", "o.json", "runs/l1l2l3/mt.json"]
    ) == ["off", "other", "l1l2l3"]
    assert distinct_labels(["mt", "mt"], ["a/run/mt.json", "b/run/mt.json"]) == [
        "a/run",
        "b/run",
    ]
    assert distinct_labels(["mt", "mt"], ["mt.json", "./mt.json"]) == ["mt #1", "mt #2"]


def _report(label: str) -> BenchReport:
    return build_report(
        [], label=label, workload="multiturn", url="http://x", backend="generate", date="",
        server={}, config={}, duration_s=1.0, timed_out=False, num_requests=0, num_ranks=1,
        routed={}, keep_output_ids=False,
    )  # fmt: skip


def test_hit_rate_chart_draws_each_run_at_its_own_x(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    drawn: list[Figure] = []
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: drawn.append(self))
    prompt_sources([_report("mt"), _report("mt")], tmp_path / "h.png")
    (ax,) = drawn[0].axes
    xs = sorted({round(bar.get_x() + bar.get_width() / 2, 6) for bar in ax.patches})
    assert xs == [0.0, 1.0]


def test_comparison_charts_carry_their_prefix(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    paths = write_charts([_report("a"), _report("b")], tmp_path, prefix=CHART_PREFIX)
    assert paths and all(p.name.startswith(CHART_PREFIX) for p in paths)
