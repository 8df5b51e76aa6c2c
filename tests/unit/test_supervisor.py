"""The launcher's restart policy, driven with fake children and a hand-set clock: exact
restart times (exponential backoff), the per-window bound, giving up, --no-restart."""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstrata.server.supervisor import RestartPolicy, Supervisor


@dataclass
class FakeChild:
    name: str
    exit_code: int | None = None
    url: str = "http://127.0.0.1:1"  # nothing listens: never healthy
    log_path: Path = Path("/dev/null")
    restarts: list[int] = field(default_factory=list)
    proc: Any = None

    def restart(self) -> None:
        self.restarts.append(len(self.restarts) + 1)
        self.exit_code = None
        self.proc = type("Proc", (), {"pid": 1000 + len(self.restarts)})()

    def log_tail(self, num_lines: int = 30) -> str:
        return "  | boom"


@dataclass
class FakeCluster:
    children: list[FakeChild]


def run(policy: RestartPolicy, exits_at_s: list[float], until_s: float) -> tuple[Any, ...]:
    """One child that exits at each of `exits_at_s` (when running); the times at which
    it was restarted, the child the supervisor gave up on (and when), and the log."""
    child, log = FakeChild("decode rank 1"), io.StringIO()
    supervisor = Supervisor(FakeCluster([child]), policy, log)  # type: ignore[arg-type]
    restarted_at_s: list[float] = []
    pending = list(exits_at_s)
    for tick in range(int(until_s * 10) + 1):
        now_s = tick / 10
        if pending and now_s >= pending[0] and child.exit_code is None:
            pending.pop(0)
            child.exit_code = -9
        num_before = len(child.restarts)
        if (dead := supervisor.poll(now_s)) is not None:
            return restarted_at_s, dead.name, now_s, log.getvalue()
        if len(child.restarts) > num_before:
            restarted_at_s.append(now_s)
    return restarted_at_s, None, None, log.getvalue()


def test_restarts_back_off_exponentially_and_are_counted_in_the_log() -> None:
    policy = RestartPolicy(backoff_s=1.0, max_backoff_s=4.0, max_restarts=10, window_s=100.0)
    restarted_at_s, dead, _, log = run(policy, [1.0, 3.0, 7.0, 20.0, 30.0], until_s=40.0)
    # delays 1, 2, 4, then capped at 4: exit + delay
    assert restarted_at_s == [2.0, 5.0, 11.0, 24.0, 34.0]
    assert dead is None
    assert "decode rank 1 exited with status -9; restart 1 (1 of at most 10 in 100 s) in 1 s" in log
    assert "restarted decode rank 1 (restart 5, pid 1005)" in log


def test_gives_up_after_max_restarts_in_the_window_but_not_across_windows() -> None:
    policy = RestartPolicy(backoff_s=0.5, max_backoff_s=0.5, max_restarts=2, window_s=10.0)
    # two exits inside 10 s are restarted; the third inside the same window is not
    restarted_at_s, dead, dead_at_s, log = run(policy, [1.0, 2.0, 3.0], until_s=20.0)
    assert (restarted_at_s, dead, dead_at_s) == ([1.5, 2.5], "decode rank 1", 3.0)
    assert "after 2 restarts in 10 s; giving up" in log
    # spread out, the window forgets old restarts
    restarted_at_s, dead, _, _ = run(policy, [1.0, 2.0, 13.0, 14.0], until_s=20.0)
    assert (restarted_at_s, dead) == ([1.5, 2.5, 13.5, 14.5], None)


def test_no_restart_gives_up_on_the_first_exit() -> None:
    restarted_at_s, dead, dead_at_s, _ = run(RestartPolicy(enabled=False), [1.0], until_s=5.0)
    assert (restarted_at_s, dead, dead_at_s) == ([], "decode rank 1", 1.0)
