"""deploy/grafana/kvstrata-dashboard.json queries only metrics kvstrata exports: every
`kvstrata_*` name in its PromQL is one the source defines (a prometheus_client Counter,
Gauge or Histogram, under the names it exposes them by, or a per-scrape gauge that a
`metrics()` method of the engine names), so a renamed metric breaks this test."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "kvstrata-dashboard.json"
# What prometheus_client exposes a metric of each type under.
SUFFIXES = {
    "Counter": ("_total", "_created"),
    "Gauge": ("",),
    "Histogram": ("_bucket", "_sum", "_count", "_created"),
}
METRIC_NAME = re.compile(r"\bkvstrata_[a-zA-Z0-9_]+")
# server/metrics.py exposes each key of the engine's metrics() dict as a gauge kvstrata_KEY.
DYNAMIC_PREFIX = "kvstrata_"


def exported_names(package: Path) -> set[str]:
    names: set[str] = set()
    for path in package.rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and node.args:
                kind = getattr(node.func, "id", getattr(node.func, "attr", None))
                first = node.args[0]
                if kind in SUFFIXES and isinstance(first, ast.Constant):
                    names.update(f"{first.value}{suffix}" for suffix in SUFFIXES[kind])
            if isinstance(node, ast.FunctionDef) and node.name == "metrics":
                for inner in ast.walk(node):
                    if isinstance(inner, ast.Dict):
                        names.update(
                            DYNAMIC_PREFIX + key.value
                            for key in inner.keys
                            if isinstance(key, ast.Constant) and isinstance(key.value, str)
                        )
    return names


def dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    exprs += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return exprs


def test_the_source_scan_finds_the_metrics_it_should() -> None:
    names = exported_names(REPO / "kvstrata")
    assert {
        "kvstrata_requests_total",
        "kvstrata_time_to_first_token_seconds_bucket",
        "kvstrata_kv_pages",
        "kvstrata_router_decisions_total",
        "kvstrata_pd_sent_bytes",
    } <= names
    assert "kvstrata_requests" not in names  # a counter is exposed with _total only


def test_every_metric_the_dashboard_queries_exists() -> None:
    exported = exported_names(REPO / "kvstrata")
    queried = {name for expr in dashboard_exprs() for name in METRIC_NAME.findall(expr)}
    assert len(queried) >= 10
    assert queried - exported == set()


def test_the_dashboard_covers_what_operators_watch() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    queried = " ".join(dashboard_exprs())
    for metric in (
        "kvstrata_time_to_first_token_seconds_bucket",
        "kvstrata_time_per_output_token_seconds_bucket",
        "kvstrata_waiting_requests",
        "kvstrata_kv_pages",
        "kvstrata_cached_tokens_total",
        "kvstrata_pd_sent_bytes",
        "kvstrata_router_decisions_total",
    ):
        assert metric in queried
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}"
