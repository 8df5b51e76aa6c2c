"""The benchmark scripts end a bad command line in one line naming the flag, not a
traceback: an experiment given a missing trace, the offline bench on a host without CUDA."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _script(path: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, str(REPO / path), *args], capture_output=True, text=True, env=env,
        cwd=REPO, timeout=120,
    )  # fmt: skip


def test_routing_comparison_names_a_missing_trace(tmp_path: Path) -> None:
    missing = tmp_path / "none.jsonl"
    done = _script(
        "bench/experiments/routing_comparison.py", "--trace", str(missing), "--out", str(tmp_path)
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"routing_comparison.py: error: --trace {missing}: no such file (the trace: "
        "https://raw.githubusercontent.com/kvcache-ai/Mooncake/main/FAST25-release/traces/"
        "synthetic_trace.jsonl)"
    ]
    assert not list(tmp_path.iterdir())  # refused before anything started or was written


def test_offline_bench_without_cuda_names_smoke(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA: bench/offline.py runs here")
    done = _script("bench/offline.py", "--out", str(tmp_path / "r.json"))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("offline.py: error: W1-W3")
    assert "--smoke" in done.stderr and not (tmp_path / "r.json").exists()
