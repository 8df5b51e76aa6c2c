"""Two guards of the test session, registered by tests/conftest.py. `ChildGuard`: every
process pytest starts dies with it, even when pytest is SIGKILLed (the OOM killer): its
Popen children ask for PR_SET_PDEATHSIG SIGKILL, and any descendant still running when
the session ends is killed and named in the summary. `RssGuard`: a thread sums the RSS of
pytest and all its descendants every 0.5 s; the peak (with the test running then and the
largest processes) is printed at the end, and a peak above $KVSTRATA_TEST_MAX_RSS_GB
(default 6, in GiB) fails the session. It also collects garbage after a test that left
pytest 0.5 GiB larger: an in-process engine (a 1 GiB L1 pool on CPU by default) that
ends in a reference cycle is otherwise freed only by a later full collection, and the
unit tests piled up 10 GiB that way."""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import signal
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvstrata.cluster.child import die_with_parent

MAX_RSS_ENV = "KVSTRATA_TEST_MAX_RSS_GB"
DEFAULT_MAX_RSS_GB = 6.0
SAMPLE_INTERVAL_S = 0.5
_GIB = 1 << 30
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
_SHOWN_PROCESSES = 6
COLLECT_AFTER_GROWTH_BYTES = 512 << 20


@dataclass(frozen=True)
class Proc:
    pid: int
    rss_bytes: int
    command: str


def descendants(root_pid: int) -> list[int]:
    """The live processes below `root_pid` (by parent pid, read from /proc), zombies out."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if stat[0] != "Z":  # fields after the name: state, ppid, ...
            children.setdefault(int(stat[1]), []).append(int(entry))
    found, stack = [], list(children.get(root_pid, []))
    while stack:
        pid = stack.pop()
        found.append(pid)
        stack.extend(children.get(pid, []))
    return found


def _own_rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * _PAGE_BYTES


def process_tree(root_pid: int) -> list[Proc]:
    """`root_pid` and its descendants with their resident memory and command line."""
    procs = []
    for pid in [root_pid, *descendants(root_pid)]:
        try:
            rss_pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError, IndexError):
            continue  # it ended meanwhile
        procs.append(Proc(pid, rss_pages * _PAGE_BYTES, command.strip()))
    return procs


class ChildGuard:
    """Children of pytest die with it; leftovers are killed at the end of the session."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.killed: list[Proc] = []
        self._original_init: Any = None

    def install(self) -> None:
        """Give every `subprocess.Popen` of this process (the harnesses', the tests', the
        in-process launcher's own are already set) a parent-death signal, unless it sets
        its own preexec_fn. SIGKILL: a frozen (SIGSTOPped) rank never acts on SIGTERM."""
        original = self._original_init = subprocess.Popen.__init__
        pid = self.pid

        @functools.wraps(original)
        def init(popen: subprocess.Popen[Any], *args: Any, **kwargs: Any) -> None:
            if kwargs.get("preexec_fn") is None and os.getpid() == pid:
                kwargs["preexec_fn"] = functools.partial(die_with_parent, signal.SIGKILL, pid)
            original(popen, *args, **kwargs)

        subprocess.Popen.__init__ = init  # type: ignore[method-assign]

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self._original_init is not None:
            subprocess.Popen.__init__ = self._original_init  # type: ignore[method-assign]
        # Every fixture has been torn down: whatever still runs was left behind.
        self.killed = [p for p in process_tree(self.pid) if p.pid != self.pid]
        for proc in self.killed:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if self.killed:
            terminalreporter.write_sep("=", "processes left running by the tests (killed)")
            for proc in self.killed:
                terminalreporter.write_line(f"pid {proc.pid}: {proc.command[:200]}")


@dataclass(eq=False)  # a pytest plugin: hashed by identity
class RssGuard:
    """The peak summed RSS of the session's process tree, sampled on a daemon thread."""

    max_rss_gb: float = field(
        default_factory=lambda: float(os.environ.get(MAX_RSS_ENV, DEFAULT_MAX_RSS_GB))
    )
    peak_bytes: int = 0
    peak_test: str = "(collection)"
    peak_procs: list[Proc] = field(default_factory=list)
    current_test: str = "(collection)"
    collected_at_bytes: int = 0  # pytest's own RSS after the last collection
    num_collections: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._sample, name="rss-guard", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        root = os.getpid()
        while True:
            procs = process_tree(root)
            total = sum(p.rss_bytes for p in procs)
            if total > self.peak_bytes:
                self.peak_bytes, self.peak_test, self.peak_procs = total, self.current_test, procs
            if self._stop.wait(SAMPLE_INTERVAL_S):
                return

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_logstart(self, nodeid: str) -> None:
        self.current_test = nodeid

    def pytest_runtest_logfinish(self, nodeid: str) -> None:
        """After the test's own fixtures are gone: collect if pytest grew by more than
        COLLECT_AFTER_GROWTH_BYTES since the last collection (a cheap /proc read when not)."""
        if _own_rss_bytes() - self.collected_at_bytes > COLLECT_AFTER_GROWTH_BYTES:
            gc.collect()
            self.num_collections += 1
            self.collected_at_bytes = _own_rss_bytes()

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.peak_bytes > self.max_rss_gb * _GIB and session.exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        over = self.peak_bytes > self.max_rss_gb * _GIB
        terminalreporter.write_sep("=", "suite memory", red=over, bold=over)
        terminalreporter.write_line(
            f"SUITE_PEAK_TREE_RSS_GIB {self.peak_bytes / _GIB:.2f} (pytest and every process "
            f"it started, summed; bound {self.max_rss_gb:g}, ${MAX_RSS_ENV}) during "
            f"{self.peak_test}"
            + (": OVER THE BOUND, the session fails" if over else "")
            + f"; {self.num_collections} garbage collections after tests that grew pytest"
        )
        for proc in sorted(self.peak_procs, key=lambda p: -p.rss_bytes)[:_SHOWN_PROCESSES]:
            terminalreporter.write_line(
                f"  {proc.rss_bytes / (1 << 20):7.0f} MiB  {proc.command[:140]}"
            )
