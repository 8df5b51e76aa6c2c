"""Keeps a launched cluster running: a child (rank or router) that exits is started again
on its own port after an exponential backoff, at most `max_restarts` times per window,
each exit and restart written to the launcher's log. Meanwhile the router's health polls
keep requests away from a dead rank and take it back once it answers on the same URL. A
restarted child is healthy again only once the answer on its port is its own."""

from __future__ import annotations

import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TextIO

from kvstrata.cluster.port_owner import PortOwner

if TYPE_CHECKING:
    from kvstrata.cluster.launch import Child, Cluster

_HEALTH_TIMEOUT_S = 1.0
_LOG_TAIL_LINES = 10


@dataclass(frozen=True)
class RestartPolicy:
    """When a child that exited is started again. The delay before restart n of the
    current window is `backoff_s * 2**(n-1)`, capped at `max_backoff_s`."""

    enabled: bool = True
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    max_restarts: int = 5
    window_s: float = 300.0

    def delay_s(self, num_recent_restarts: int) -> float:
        return min(self.backoff_s * 2.0 ** max(num_recent_restarts - 1, 0), self.max_backoff_s)


@dataclass
class _ChildRecord:
    restart_times_s: deque[float] = field(default_factory=deque)  # within the window
    num_restarts: int = 0  # since the cluster started
    restart_at_s: float | None = None  # a restart is due then (None: it is running)
    awaiting_health: bool = False  # restarted, /health not seen yet
    said_port_taken: bool = False  # since the restart: another process answers on its port


class Supervisor:
    """Call `poll()` every fraction of a second from the thread that launched the
    cluster (children die with that thread). It returns the child whose exit ends the
    cluster (restarts disabled, or more than `max_restarts` in the window), else None."""

    def __init__(self, cluster: Cluster, policy: RestartPolicy, log: TextIO = sys.stderr) -> None:
        self.cluster = cluster
        self.policy = policy
        self.log = log
        self._records = {id(child): _ChildRecord() for child in cluster.children}

    def num_restarts(self, child: Child) -> int:
        return self._records[id(child)].num_restarts

    def poll(self, now_s: float | None = None) -> Child | None:
        now_s = time.monotonic() if now_s is None else now_s
        for child in self.cluster.children:
            record = self._records[id(child)]
            if record.restart_at_s is not None:
                if now_s >= record.restart_at_s:
                    self._restart(child, record, now_s)
            elif child.exit_code is not None:
                if not self._schedule(child, record, now_s):
                    return child
            elif record.awaiting_health:
                self._check_health(child, record)
        return None

    def _check_health(self, child: Child, record: _ChildRecord) -> None:
        """A restarted child is healthy again once /health answers 200 from the child
        itself: another process answering on its port (say a foreign router on the port
        of the one that died) is said once, and never taken for the child."""
        if child.is_healthy(_HEALTH_TIMEOUT_S):
            record.awaiting_health = False
            self._say(
                f"{child.name} is healthy again on {child.url} (restart {record.num_restarts})"
            )
        elif not record.said_port_taken and child.owner(_HEALTH_TIMEOUT_S) is PortOwner.OTHER:
            record.said_port_taken = True
            self._say(
                f"another process answers on {child.url}, not the restarted "
                f"{child.name}: its port is taken"
            )

    def _schedule(self, child: Child, record: _ChildRecord, now_s: float) -> bool:
        """A child exited: plan its restart; False if it may not be restarted."""
        if not self.policy.enabled:
            return False
        while record.restart_times_s and record.restart_times_s[0] <= now_s - self.policy.window_s:
            record.restart_times_s.popleft()
        num_recent = len(record.restart_times_s)
        if num_recent >= self.policy.max_restarts:
            self._say(
                f"{child.name} exited with status {child.exit_code} after {num_recent} "
                f"restarts in {self.policy.window_s:g} s; giving up"
            )
            return False
        delay_s = self.policy.delay_s(num_recent + 1)
        record.restart_at_s = now_s + delay_s
        record.awaiting_health = False
        self._say(
            f"{child.name} exited with status {child.exit_code}; restart "
            f"{record.num_restarts + 1} ({num_recent + 1} of at most {self.policy.max_restarts} "
            f"in {self.policy.window_s:g} s) in {delay_s:g} s on {child.url}. Log "
            f"{child.log_path}:\n{child.log_tail(_LOG_TAIL_LINES)}"
        )
        return True

    def _restart(self, child: Child, record: _ChildRecord, now_s: float) -> None:
        record.restart_at_s = None
        record.restart_times_s.append(now_s)
        record.num_restarts += 1
        record.awaiting_health = True
        record.said_port_taken = False
        child.restart()
        assert child.proc is not None
        self._say(
            f"restarted {child.name} (restart {record.num_restarts}, pid "
            f"{child.proc.pid}) on {child.url}"
        )

    def _say(self, text: str) -> None:
        print(f"kvstrata launch: {text}", file=self.log, flush=True)
