"""A pytest killed by SIGKILL (the OOM killer) leaves no child running (issue 27, item 8):
every process the suite starts asks for PR_SET_PDEATHSIG SIGKILL (tests/suite_guards.py),
so a frozen rank and a process in a session of its own die with the session that started
them. A session that ends normally kills what its tests left running and names it, and
fails when its process tree went over the memory bound."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from killed_session import PIDS_ENV

WAIT_S = 240.0


def is_running(pid: int) -> bool:
    """Alive and not a zombie waiting for its reaper."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def session_of(test: str, pids_file: Path, **env: str) -> subprocess.Popen[bytes]:
    """A pytest session of killed_session.py's `test`."""
    return subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         f"{Path(__file__).with_name('killed_session.py')}::{test}"],
        env={**os.environ, PIDS_ENV: str(pids_file), **env}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )  # fmt: skip


def test_a_sigkilled_pytest_leaves_no_child(tmp_path: Path) -> None:
    pids_file = tmp_path / "pids"
    session = session_of("test_start_children_and_wait_to_be_killed", pids_file)
    deadline_s = time.monotonic() + WAIT_S
    while not pids_file.exists():
        assert session.poll() is None, session.communicate()[0].decode()[-3000:]
        assert time.monotonic() < deadline_s, "the session never started its children"
        time.sleep(0.1)
    pids = [int(pid) for pid in pids_file.read_text().split()]
    assert len(pids) == 2 and all(map(is_running, pids))
    session.kill()
    session.wait(timeout=30)
    deadline_s = time.monotonic() + 30
    while running := [pid for pid in pids if is_running(pid)]:
        assert time.monotonic() < deadline_s, f"left running after pytest died: {running}"
        time.sleep(0.1)


def test_a_session_kills_what_it_left_and_fails_over_its_memory_bound(tmp_path: Path) -> None:
    pids_file = tmp_path / "pids"
    ended = session_of("test_leave_a_child_running", pids_file, KVSTRATA_TEST_MAX_RSS_GB="0.01")
    output = ended.communicate(timeout=WAIT_S)[0].decode()
    assert ended.returncode == 1 and "1 passed" in output  # the bound failed it, not the test
    assert "SUITE_PEAK_TREE_RSS_GIB" in output and "OVER THE BOUND" in output
    (pid,) = map(int, pids_file.read_text().split())
    assert f"pid {pid}: sleep 600" in output  # named under "processes left running"
    assert not is_running(pid)
