"""The GPU experiments on a host without CUDA (issue 27, item 8): they fail within seconds
naming --device cpu instead of building random qwen3-8b weights for minutes, and a run
stopped by SIGTERM while it builds its random model leaves nothing in the temp dir."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXPERIMENTS = REPO / "bench" / "experiments"
WAIT_S = 120.0


def environment(tmp_dir: Path) -> dict[str, str]:
    """No CUDA device (whatever the host has), and a temp dir of the test's own."""
    tmp_dir.mkdir(exist_ok=True)
    return {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": "",
            "TMPDIR": str(tmp_dir)}  # fmt: skip


@pytest.mark.parametrize("script", ["pd_overlap.py", "pd_l3_restore.py"])
def test_a_gpu_experiment_on_a_cpu_host_fails_at_once_naming_the_flag(
    script: str, tmp_path: Path
) -> None:
    done = subprocess.run(
        [sys.executable, str(EXPERIMENTS / script), "--out", str(tmp_path / "out")],
        capture_output=True, text=True, env=environment(tmp_path / "tmp"), cwd=REPO,
        timeout=WAIT_S,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"{script}: error: --device cuda: torch sees no CUDA device")
    assert "pass --device cpu" in line
    assert not list((tmp_path / "tmp").iterdir())  # nothing was built


def test_sigterm_while_the_random_model_is_built_removes_it(tmp_path: Path) -> None:
    tmp_dir = tmp_path / "tmp"
    run = subprocess.Popen(
        [sys.executable, str(EXPERIMENTS / "pd_overlap.py"), "--device", "cpu",
         "--preset", "qwen3-0.6b", "--out", str(tmp_path / "out")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=environment(tmp_dir), cwd=REPO,
    )  # fmt: skip
    assert run.stdout is not None
    first = run.stdout.readline()  # said before the first weight is drawn
    assert first.startswith("building a random qwen3-0.6b model in "), first
    model = Path(first.split(" in ", 1)[1].split(" (")[0])
    deadline_s = time.monotonic() + WAIT_S
    while not (model / "config.json").exists():  # the weights come after it
        assert run.poll() is None and time.monotonic() < deadline_s
        time.sleep(0.01)
    run.send_signal(signal.SIGTERM)
    _, err = run.communicate(timeout=WAIT_S)
    assert run.returncode == 128 + signal.SIGTERM
    assert err.strip().endswith("pd_overlap.py: stopped by SIGTERM; cleaned up")
    assert not list(tmp_dir.iterdir())
