"""Not collected by the suite (no test_ prefix): the sessions tests/e2e/test_killed_pytest.py
runs. One starts processes the way the suite does (a rank through the e2e harness, frozen
as the fault tests freeze ranks; a process in a session of its own, as mooncake_master and
the README's servers), writes their pids to $KVSTRATA_KILLED_SESSION_PIDS and waits to be
SIGKILLed; the other leaves a process running when it ends."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from server_harness import SERVER_FLAGS, start_server

PIDS_ENV = "KVSTRATA_KILLED_SESSION_PIDS"


def test_start_children_and_wait_to_be_killed(tiny_llama: Path, tmp_path: Path) -> None:
    rank = start_server(tiny_llama, tmp_path, *SERVER_FLAGS)
    rank.proc.send_signal(signal.SIGSTOP)  # a frozen process never acts on SIGTERM
    own_session = subprocess.Popen(["sleep", "600"], start_new_session=True)
    path = Path(os.environ[PIDS_ENV])
    path.with_suffix(".part").write_text(f"{rank.proc.pid} {own_session.pid}")
    path.with_suffix(".part").rename(path)  # the waiting test sees it whole or not at all
    time.sleep(600)


def test_leave_a_child_running() -> None:
    leftover = subprocess.Popen(["sleep", "600"], start_new_session=True)
    Path(os.environ[PIDS_ENV]).write_text(str(leftover.pid))
