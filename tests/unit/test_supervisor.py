"""The launcher's restart policy, driven with fake children and a hand-set clock: exact
restart times (exponential backoff), the per-window bound, giving up, --no-restart; and a
restarted router whose port another server answers is never called healthy again."""

from __future__ import annotations

import io
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from kvstrata.cluster.child import Child
from kvstrata.cluster.port_owner import PortOwner, new_proof_key
from kvstrata.cluster.supervisor import RestartPolicy, Supervisor


@dataclass
class FakeChild:
    name: str
    exit_code: int | None = None
    url: str = "http://127.0.0.1:1"  # nothing listens: never healthy
    log_path: Path = Path("/dev/null")
    restarts: list[int] = field(default_factory=list)
    proc: Any = None
    proof_key: str | None = None

    def owner(self, timeout_s: float = 1.0) -> PortOwner:
        return PortOwner.NOBODY

    def is_healthy(self, timeout_s: float = 1.0) -> bool:
        return False

    def restart(self) -> None:
        self.restarts.append(len(self.restarts) + 1)
        self.exit_code = None
        self.proc = type("Proc", (), {"pid": 1000 + len(self.restarts)})()

    def log_tail(self, num_lines: int = 30) -> str:
        return "  | boom"


class FakeRouter(FakeChild):
    """Asks whatever listens on `url` for its launch proof, as a launched router's Child."""

    owner = Child.owner
    is_healthy = Child.is_healthy


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


class _Foreign(BaseHTTPRequestHandler):
    """Another cluster's router, as far as /health goes: 200 and kvstrata's counts."""

    def do_GET(self) -> None:
        found = self.path == "/health"
        body = json.dumps({"status": "ok"} if found else {"detail": "Not Found"}).encode()
        self.send_response(200 if found else 404)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@contextmanager
def foreign_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Foreign)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_foreign_server_on_a_restarted_routers_port_is_not_the_router() -> None:
    """Issue 27, item 7: the router died on `address already in use` and each restart was
    logged "healthy again" because another cluster's router answered /health there."""
    with foreign_server() as url:
        router, log = FakeRouter("router", url=url, proof_key=new_proof_key()), io.StringIO()
        supervisor = Supervisor(FakeCluster([router]), RestartPolicy(backoff_s=0.5), log)  # type: ignore[arg-type]
        router.exit_code = 1
        for tick in range(10):  # exits at 0, restarted at 0.5 s, then polled for 0.4 s
            supervisor.poll(tick / 10)
        assert router.restarts == [1] and router.owner(1.0) is PortOwner.OTHER
        text = log.getvalue()
        assert "healthy again" not in text
        assert text.count(f"another process answers on {url}, not the restarted router") == 1
