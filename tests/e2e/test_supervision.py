"""Launch supervision (issue 15, item 6), real processes: under `kvstrata launch` a decode
rank killed while requests flow is restarted on its own port and the router takes it back,
while the other ranks keep answering; the launcher's log counts the restart. With
--no-restart one dead rank stops the whole cluster, as before."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from test_launch import CHILD_LINE, RANK_FLAGS, is_alive

WAIT_S = 240.0
NUM_CLIENTS = 3


@dataclass
class Launcher:
    proc: subprocess.Popen[str]
    lines: queue.Queue[str | None] = field(default_factory=queue.Queue)
    output: list[str] = field(default_factory=list)

    def wait_for(self, prefix: str, timeout_s: float = WAIT_S) -> str:
        """The first line (from here on) of the launcher's output that contains `prefix`."""
        deadline_s = time.monotonic() + timeout_s
        while True:
            line = self.lines.get(timeout=max(0.0, deadline_s - time.monotonic()))
            assert line is not None, "the launcher exited:\n" + "\n".join(self.output)
            self.output.append(line)
            if prefix in line:
                return line

    def children(self) -> dict[str, tuple[str, int]]:
        return {m[1]: (m[2], int(m[3])) for line in self.output if (m := CHILD_LINE.match(line))}


def start_launcher(
    model: Path, log_dir: Path, *flags: str, env: dict[str, str] | None = None
) -> Launcher:
    """`kvstrata launch` with `flags` (and `env` for it and its children, if given)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstrata", "launch", "--model", str(model), "--port", "0",
         "--log-dir", str(log_dir), "--load-poll-interval-s", "0.2", *flags, *RANK_FLAGS],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    launcher = Launcher(proc)

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            launcher.lines.put(line.rstrip("\n"))
        launcher.lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    launcher.wait_for("ready: ")
    return launcher


@pytest.fixture()
def stop_at_end() -> Iterator[list[Launcher]]:
    launchers: list[Launcher] = []
    yield launchers
    for launcher in launchers:
        if launcher.proc.poll() is None:
            launcher.proc.send_signal(signal.SIGTERM)
            launcher.proc.wait(timeout=120)


class Traffic:
    """Clients sending greedy /generate requests through the router until stopped."""

    def __init__(self, router_url: str) -> None:
        self.router_url = router_url
        self.statuses: list[int | str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(NUM_CLIENTS)]
        for thread in self._threads:
            thread.start()

    def _run(self, client: int) -> None:
        with httpx.Client(base_url=self.router_url, timeout=120) as http:
            turn = 0
            while not self._stop.is_set():
                prompt = [3 + client, 4 + turn % 50, *range(5, 40)]
                body = {"input_ids": prompt,
                        "sampling_params": {"max_new_tokens": 16, "temperature": 0}}  # fmt: skip
                try:
                    self.statuses.append(http.post("/generate", json=body).status_code)
                except httpx.HTTPError as e:
                    self.statuses.append(type(e).__name__)
                turn += 1

    def num_ok(self) -> int:
        return self.statuses.count(200)

    def stop(self) -> list[int | str]:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=120)
        return self.statuses


def wait_until(condition: object, what: str, timeout_s: float = WAIT_S) -> None:
    deadline_s = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline_s, f"timed out waiting until {what}"
        time.sleep(0.2)


def rank_health(router_url: str) -> dict[str, bool]:
    loads = httpx.get(router_url + "/get_load", timeout=10).json()
    return {f"{r['role']} rank {r['index']}": r["healthy"] for r in loads}


def test_a_killed_decode_rank_is_restarted_while_the_others_serve(
    tiny_llama: Path, tmp_path: Path, stop_at_end: list[Launcher]
) -> None:
    launcher = start_launcher(tiny_llama, tmp_path, "--num-prefill", "1", "--num-decode", "2",
                              "--restart-backoff-s", "0.5", "--load-balance-method", "round_robin",
                              "--rank-devices", "cpu", "cpu", "cpu")  # fmt: skip
    stop_at_end.append(launcher)
    children = launcher.children()
    router_url = children["router"][0]
    rank_url, rank_pid = children["decode rank 1"]
    traffic = Traffic(router_url)
    try:
        wait_until(lambda: traffic.num_ok() >= 10, "requests flow")
        os.kill(rank_pid, signal.SIGKILL)
        num_sent_at_kill = len(traffic.statuses)
        line = launcher.wait_for("decode rank 1 exited with status -9; restart 1 ")
        assert f"on {rank_url}" in line
        wait_until(lambda: not rank_health(router_url)["decode rank 1"], "the router sees it down")
        # Meanwhile the other decode rank keeps answering everything.
        num_ok_while_down = traffic.num_ok()
        wait_until(lambda: traffic.num_ok() >= num_ok_while_down + 10, "the others serve")
        launcher.wait_for("restarted decode rank 1 (restart 1, pid ")
        launcher.wait_for("decode rank 1 is healthy again on " + rank_url)
        wait_until(lambda: rank_health(router_url)["decode rank 1"], "the router takes it back")
    finally:
        statuses = traffic.stop()
    # Back in rotation on the same URL: round robin gives it every other request.
    served_by = []
    for turn in range(4):
        body = {"input_ids": [9, turn, *range(3, 30)], "sampling_params": {"max_new_tokens": 4}}
        response = httpx.post(router_url + "/generate", json=body, timeout=60)
        assert response.status_code == 200, response.text
        served_by.append(response.json()["usage"]["kvstrata"]["rank"])
    assert sorted(set(served_by)) == [0, 1], served_by
    failures = [s for s in statuses if s != 200]
    print(f"{len(statuses)} requests, {num_sent_at_kill} before the kill; failed: {failures}")
    # At most the requests that were in flight on the killed rank fail (one per client).
    assert len(failures) <= NUM_CLIENTS, (failures, num_sent_at_kill)
    assert all(s in (502, 503) for s in failures), failures
    assert launcher.proc.poll() is None
    launcher.proc.send_signal(signal.SIGTERM)
    assert launcher.proc.wait(timeout=120) == 0


def test_no_restart_stops_the_cluster_when_a_rank_dies(
    tiny_llama: Path, tmp_path: Path, stop_at_end: list[Launcher]
) -> None:
    launcher = start_launcher(tiny_llama, tmp_path, "--num-prefill", "1", "--num-decode", "2",
                              "--no-restart", "--rank-devices", "cpu", "cpu", "cpu")  # fmt: skip
    stop_at_end.append(launcher)
    children = launcher.children()
    os.kill(children["decode rank 1"][1], signal.SIGKILL)
    launcher.wait_for("decode rank 1 exited with status -9; stopping the cluster")
    assert launcher.proc.wait(timeout=120) == 1
    assert not [name for name, (_, pid) in children.items() if is_alive(pid)]
