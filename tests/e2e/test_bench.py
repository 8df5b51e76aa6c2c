"""`kvstrata bench` against a live cluster (1 prefill + 1 decode rank with the decode radix
cache, router in front): every workload runs with every request answered, the results
JSON has every field and round-trips, the prompt tokens split exactly into per-tier hits
plus transferred tokens, and the CLI writes JSON, charts and comparisons."""

from __future__ import annotations

import dataclasses
import itertools
import json
import shutil
import subprocess
import sys
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pd_harness import assert_rank_idle

from kvstrata.bench.config import BenchConfig
from kvstrata.bench.report import BenchReport
from kvstrata.bench.run import load_report, run_bench, save_report
from kvstrata.cluster.launch import Cluster, launch_cluster
from kvstrata.cluster.launch_config import LaunchConfig

PAGE = 16
RANK_FLAGS = (
    "--page-size",
    str(PAGE),
    "--num-kv-pages",
    "512",
    "--max-model-len",
    "1024",
    "--disaggregation-decode-enable-radix-cache",
    # The PD checks below count transferred tokens: every prompt goes to the prefill rank.
    "--disaggregation-decode-local-prefill",
    "never",
    "--log-level",
    "warning",
)
TINY: dict[str, dict[str, Any]] = {
    "multiturn": {
        "num_clients": 2,
        "num_rounds": 3,
        "first_prompt_len": 40,
        "question_len": 12,
        "output_len": 4,
    },
    "shared-prefix": {
        "num_groups": 2,
        "prompts_per_group": 3,
        "system_prompt_len": 64,
        "question_len": 8,
        "output_len": 3,
        "max_concurrency": 1,
    },
    "trace": {"trace_block_size": 4, "max_output_len": 3, "trace_speed": 50.0},
}
TRACE = [  # timestamp ms, input length, output length, hash ids (4-token blocks)
    (0, 10, 2, [0, 1, 2]),
    (10, 12, 2, [0, 1, 3]),
    (20, 5, 1, [0, 4]),
    (30, 4, 5, [5]),
    (40, 13, 2, [0, 1, 2, 6]),
]


@pytest.fixture(scope="module")
def cluster(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    logs = tmp_path_factory.mktemp("bench-cluster")
    config = LaunchConfig(
        model=str(tiny_llama), num_prefill=1, num_decode=1, port=0, log_dir=str(logs)
    )
    with launch_cluster(config, RANK_FLAGS) as running:
        yield running
    assert all(child.exit_code == 0 for child in running.children)


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("trace") / "trace.jsonl"
    rows = [
        {"timestamp": t, "input_length": n, "output_length": o, "hash_ids": h}
        for t, n, o, h in TRACE
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def assert_has_every_field(body: Any, cls: type) -> None:
    """`body` (JSON) has a key for every field of the dataclass `cls`, recursively."""
    hints = typing.get_type_hints(cls)
    assert set(body) == set(hints), cls.__name__
    for name, value in body.items():
        tp = hints[name]
        nested = typing.get_args(tp)[0] if typing.get_origin(tp) is list else tp
        if not dataclasses.is_dataclass(nested):
            continue
        for item in value if isinstance(value, list) else [value]:
            assert_has_every_field(item, nested)  # type: ignore[arg-type]


def check_report(report: BenchReport, tmp_path: Path) -> None:
    assert report.errors == [] and not report.timed_out
    assert report.num_ok == report.num_sent == report.num_requests > 0
    assert report.backend == "generate" and report.server["is_router"]
    # PD: the decode rank computes no prompt token; each one is a hit or was transferred.
    for r in report.requests:
        tiers = [r.cached_tokens_l1, r.cached_tokens_l2, r.cached_tokens_l3]
        assert sum(tiers) + r.transferred_tokens == r.prompt_tokens, r
        assert r.cached_tokens == sum(tiers)
        assert r.output_ids is not None and len(r.output_ids) == r.output_tokens
        assert r.ttft_s is not None and r.ttft_s <= r.e2e_s
    t = report.tiers
    assert t.prompt_tokens == sum(r.prompt_tokens for r in report.requests)
    assert t.cached_tokens_l1 + t.cached_tokens_l2 + t.cached_tokens_l3 == t.cached_tokens
    assert t.cached_tokens + t.transferred_tokens == t.prompt_tokens and t.computed_tokens == 0
    assert report.ttft_s.n == report.e2e_s.n == report.num_ok
    # The router's own count of what it sent to the one decode rank.
    assert [(rank.rank, rank.num_requests, rank.num_routed) for rank in report.ranks] == [
        (0, report.num_ok, report.num_ok)
    ]
    path = tmp_path / "results.json"
    save_report(report, path)
    assert_has_every_field(json.loads(path.read_text()), BenchReport)
    assert load_report(path) == report


@pytest.mark.parametrize("workload", list(TINY))
def test_every_workload_runs_and_reports(
    cluster: Cluster, trace_file: Path, tmp_path: Path, workload: str
) -> None:
    trace = {"trace": str(trace_file)} if workload == "trace" else {}
    config = BenchConfig(
        url=cluster.router_url, workload=workload, progress=False, **TINY[workload], **trace
    )
    report = run_bench(config)
    check_report(report, tmp_path)
    by_key = {(r.conversation, r.round): r for r in report.requests}
    if workload == "multiturn":
        assert [r.round for r in report.rounds] == [1, 2, 3]
        for (conversation, round_index), r in by_key.items():
            if round_index > 1:  # the previous round's prompt and answer are cached
                previous = by_key[(conversation, round_index - 1)]
                assert r.prompt_tokens == previous.prompt_tokens + previous.output_tokens + 12
                seen = previous.prompt_tokens + previous.output_tokens - 1
                assert r.cached_tokens_l1 >= seen // PAGE * PAGE - PAGE
    if workload == "shared-prefix":  # one at a time: later prompts of a group hit its system prompt
        for group in range(2):
            _, *later = [r for r in report.requests if r.group == group]
            assert all(r.cached_tokens_l1 >= 64 for r in later)
    if workload == "trace":
        assert [r.prompt_tokens for r in sorted(report.requests, key=lambda r: r.conversation)] == [
            10,
            12,
            5,
            4,
            13,
        ]
    with httpx.Client(base_url=cluster.decode_urls[0], timeout=30) as http:
        assert_rank_idle(http)


def test_openai_backend_sends_text(cluster: Cluster, tmp_path: Path) -> None:
    config = BenchConfig(
        url=cluster.router_url,
        workload="multiturn",
        backend="openai",
        progress=False,
        **TINY["multiturn"],
    )
    report = run_bench(config)
    assert report.backend == "openai" and report.num_ok == report.num_requests == 6
    assert report.server["model_name"]  # taken from the server, sent as `model`
    rounds = sorted(report.requests, key=lambda r: (r.conversation, r.round))
    assert all(
        b.prompt_tokens > a.prompt_tokens
        for a, b in itertools.pairwise(rounds)
        if a.conversation == b.conversation
    )
    assert report.tiers.cached_tokens + report.tiers.transferred_tokens == (
        report.tiers.prompt_tokens
    )


def kvstrata(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvstrata", *args], capture_output=True, text=True, timeout=180
    )


def test_cli_writes_results_charts_and_comparison(cluster: Cluster, tmp_path: Path) -> None:
    sizes = [
        "--num-groups",
        "1",
        "--prompts-per-group",
        "2",
        "--system-prompt-len",
        "32",
        "--question-len",
        "4",
        "--output-len",
        "2",
        "--no-progress",
    ]
    run = kvstrata(
        "bench",
        "--url",
        cluster.router_url,
        "--workload",
        "shared-prefix",
        *sizes,
        "--output",
        str(tmp_path / "a.json"),
        "--plot",
        str(tmp_path / "plots"),
    )
    assert run.returncode == 0, run.stderr
    assert "TTFT" in run.stdout and load_report(tmp_path / "a.json").num_ok == 2
    for name in ("ttft_cdf.png", "hit_rate.png"):
        assert (tmp_path / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Two runs of one label in two folders, charted into the single run's chart folder.
    (tmp_path / "again").mkdir()
    shutil.copy(tmp_path / "a.json", tmp_path / "again" / "a.json")
    single_chart = (tmp_path / "plots" / "hit_rate.png").read_bytes()
    compare = kvstrata(
        "bench",
        "compare",
        str(tmp_path / "a.json"),
        str(tmp_path / "again" / "a.json"),
        "--plot",
        str(tmp_path / "plots"),
        "--markdown",
        str(tmp_path / "t.md"),
    )
    assert compare.returncode == 0, compare.stderr
    table = (tmp_path / "t.md").read_text()
    assert table.startswith("| run | TTFT mean ms |")
    assert [row.split(" | ")[0] for row in table.splitlines()[2:]] == [
        f"| {tmp_path.name}",
        "| again",
    ]
    assert (tmp_path / "plots" / "compare_hit_rate.png").is_file()
    assert (tmp_path / "plots" / "hit_rate.png").read_bytes() == single_chart
    unreachable = kvstrata("bench", "--url", "http://127.0.0.1:1", "--no-progress")
    assert unreachable.returncode == 2 and "cannot reach" in unreachable.stderr
