"""Real clusters for the fault tests: prefill, decode and router processes on loopback with
per-role flags, each one killable, freezable and restartable on its own port; the settle
check every scenario ends with (invariants hold, nothing left in flight, no traceback);
and a tmpfs mount for L3 faults."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvstrata.cluster.launch import Child
from kvstrata.server.invariants import IN_FLIGHT

STARTUP_TIMEOUT_S = 180.0
SETTLE_TIMEOUT_S = 90.0  # bounded wait for a cluster to drain after a fault
_POLL_S = 0.05
SHM_DIR = Path("/dev/shm")


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    """Poll `condition` until it holds; fail naming `what` if it never does (bounded)."""
    deadline_s = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline_s, f"never happened within {timeout_s} s: {what}"
        time.sleep(_POLL_S)


@dataclass
class Proc:
    """One child process of the cluster (a rank or the router)."""

    child: Child
    killed_pids: list[int] = field(default_factory=list)
    old_logs: list[Path] = field(default_factory=list)  # of the processes it replaced

    @property
    def name(self) -> str:
        return self.child.name

    @property
    def url(self) -> str:
        return self.child.url

    @property
    def pid(self) -> int:
        assert self.child.proc is not None
        return self.child.proc.pid

    @property
    def alive(self) -> bool:
        return self.child.exit_code is None

    def freeze(self) -> None:
        """SIGSTOP: sockets stay open, nothing answers (a hung process)."""
        self._signal(signal.SIGSTOP)

    def thaw(self) -> None:
        if self.alive:
            self._signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL, as in a crash: no cleanup runs. A frozen process dies frozen: SIGKILL
        needs no SIGCONT, and thawing first would let it run on for a moment (and, say,
        finish a transfer a test expects to fail)."""
        assert self.child.proc is not None
        self.child.proc.kill()
        self.child.proc.wait(timeout=30)
        self.killed_pids.append(self.pid)

    def restart(self) -> None:
        """Start it again on the same port (the router and ranks know it by URL)."""
        assert not self.alive
        log_path = self.child.log_path  # kept: the new process writes a fresh log
        self.old_logs.append(log_path.with_name(f"{log_path.stem}.{self.child.num_starts}.log"))
        log_path.rename(self.old_logs[-1])
        self.child.fixed_port = int(self.url.rsplit(":", 1)[1])
        self.child.start()
        wait_healthy([self])

    def rss_bytes(self) -> int:
        """Resident memory (VmRSS) of the process now."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError(f"no VmRSS for {self.name}")

    def log(self) -> str:
        """The logs of this process and of those it replaced, oldest first."""
        paths = [*self.old_logs, self.child.log_path]
        return "".join(path.read_text(errors="replace") for path in paths)

    def _signal(self, sig: signal.Signals) -> None:
        assert self.child.proc is not None and self.alive
        self.child.proc.send_signal(sig)


def wait_healthy(procs: Sequence[Proc]) -> None:
    deadline_s = time.monotonic() + STARTUP_TIMEOUT_S
    for proc in procs:
        while True:
            assert proc.alive, f"{proc.name} exited:\n{proc.log()[-3000:]}"
            assert time.monotonic() < deadline_s, f"{proc.name} not healthy:\n{proc.log()[-3000:]}"
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(proc.url + "/health", timeout=5).status_code == 200:
                    break
            time.sleep(0.1)


def _child(name: str, argv: list[str], log_path: Path) -> Child:
    # SIGKILL when pytest dies, even by SIGKILL: a frozen child would never act on SIGTERM.
    return Child(name, argv, "127.0.0.1", log_path, fixed_port=0, death_signal=signal.SIGKILL)


class FaultCluster:
    """`num_prefill` prefill ranks (0: the decode ranks are unified ranks), `num_decode`
    decode ranks and a router, each role with its own flags. Use as a context manager."""

    def __init__(
        self, model: Path, log_dir: Path, prefill_flags: Sequence[str] = (),
        decode_flags: Sequence[str] = (), router_flags: Sequence[str] = (),
        num_prefill: int = 1, num_decode: int = 1,
    ) -> None:  # fmt: skip
        self.model = model
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        pd = num_prefill > 0
        self.prefill = [
            self._rank(f"prefill-{i}", i, "prefill", prefill_flags) for i in range(num_prefill)
        ]
        mode = "decode" if pd else "null"
        if pd:  # the faults here are the prefill rank's; decode_flags may choose local prefill
            decode_flags = ["--disaggregation-decode-local-prefill", "never", *decode_flags]
        self.decode = [self._rank(f"decode-{i}", i, mode, decode_flags) for i in range(num_decode)]
        self.router_flags = list(router_flags)
        self.router: Proc | None = None

    def _rank(self, name: str, index: int, mode: str, flags: Sequence[str]) -> Proc:
        argv = ["serve", "--model", str(self.model), "--host", "127.0.0.1", "--rank", str(index),
                "--disaggregation-mode", mode, *flags]  # fmt: skip
        return Proc(_child(name, argv, self.log_dir / f"{name}.log"))

    @property
    def ranks(self) -> list[Proc]:
        return self.prefill + self.decode

    @property
    def procs(self) -> list[Proc]:
        return self.ranks + ([self.router] if self.router is not None else [])

    @property
    def url(self) -> str:
        assert self.router is not None
        return self.router.url

    def start(self) -> FaultCluster:
        for rank in self.ranks:  # all at once: they load in parallel
            rank.child.start()
        wait_healthy(self.ranks)
        prefill = ["--prefill", *(p.url for p in self.prefill)] if self.prefill else []
        argv = ["router", *prefill, "--decode", *(d.url for d in self.decode),
                "--host", "127.0.0.1", "--model", str(self.model), "--log-level", "warning",
                "--load-poll-interval-s", "0.2", *self.router_flags]  # fmt: skip
        self.router = Proc(_child("router", argv, self.log_dir / "router.log"))
        self.router.child.start()
        wait_healthy([self.router])
        return self

    def stop(self) -> None:
        """Thaw, SIGTERM the router first, then the ranks; SIGKILL what lingers. Removes
        the shared-memory KV pools of ranks that were killed (nothing else can)."""
        for proc in self.procs:
            if proc.alive:
                proc.thaw()
                assert proc.child.proc is not None
                proc.child.proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            assert proc.child.proc is not None
            try:
                proc.child.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.child.proc.kill()
                proc.child.proc.wait()
        for proc in self.procs:
            for pid in proc.killed_pids:
                for path in SHM_DIR.glob(f"kvstrata-kv-{pid}-*"):
                    path.unlink(missing_ok=True)

    def heal(self) -> None:
        """Thaw every process and restart the dead ones (after a test that failed midway,
        so the next test of the module starts from a whole cluster)."""
        for proc in self.procs:
            if proc.alive:
                proc.thaw()
            else:
                proc.restart()

    def __enter__(self) -> FaultCluster:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- checks -------------------------------------------------------------------

    def invariants(self, rank: Proc) -> dict[str, Any]:
        response = httpx.get(rank.url + "/debug/invariants", timeout=30)
        assert response.status_code == 200, f"{rank.name}: {response.text}"
        return response.json()

    def idle(self, rank: Proc) -> bool:
        """Nothing in flight on `rank` (failing at once if an invariant breaks), but for
        leftovers of a reported bug, which are warned about."""
        report = self.invariants(rank)
        assert report["ok"], f"{rank.name}: {report['violations']} {report['counts']}"
        if report["idle"]:
            return True
        counts = report["counts"]
        busy = {name for name in IN_FLIGHT if counts.get(name, 0)}
        # Known bug (kvstrata/pd/prefill_endpoints.py): a room whose engine request finished just as
        # its decode rank hung up is never collected. No handler is left to collect it.
        if busy == {"prefill_rooms"} and not counts.get("prefill_rooms_http"):
            warnings.warn(
                f"{rank.name}: {counts['prefill_rooms']} uncollected prefill room(s): the "
                "known pd.py leak (docs/reliability.md)", stacklevel=2,
            )  # fmt: skip
            return True
        return False

    def settle(self, timeout_s: float = SETTLE_TIMEOUT_S) -> None:
        """Once the load has stopped: wait (bounded) until no rank has anything in flight
        and the router holds no request, failing at once if any invariant breaks."""
        deadline_s = time.monotonic() + timeout_s
        for rank in self.ranks:
            while rank.alive and not self.idle(rank):
                assert time.monotonic() < deadline_s, f"{rank.name} never idle: " + str(
                    self.invariants(rank)
                )
                time.sleep(_POLL_S)
        if self.router is not None and self.router.alive:
            wait_for(
                lambda: all(r["num_inflight"] == 0 for r in self.router_load()),
                "the router holds no request", max(1.0, deadline_s - time.monotonic()),
            )  # fmt: skip

    def router_load(self) -> list[dict[str, Any]]:
        return httpx.get(self.url + "/get_load", timeout=30).json()

    def wait_router_sees(self, rank: Proc, healthy: bool) -> None:
        def seen() -> bool:
            return any(r["url"] == rank.url and r["healthy"] is healthy for r in self.router_load())

        wait_for(seen, f"the router marks {rank.name} {'healthy' if healthy else 'unhealthy'}")

    def metric(self, rank: Proc, name: str) -> float:
        """One unlabelled sample of a rank's /metrics (0 if absent)."""
        for line in httpx.get(rank.url + "/metrics", timeout=30).text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        return 0.0

    def tracebacks(self) -> dict[str, list[str]]:
        """The last line of each Python traceback a child logged (an unhandled error),
        except those of bugs already reported in docs/reliability.md (KNOWN_BUGS)."""
        found = {p.name: [last for last, text in _tracebacks(p.log()) if not _known(text)]
                 for p in self.procs}  # fmt: skip
        return {name: errors for name, errors in found.items() if errors}


# Tracebacks of reported bugs whose fix is not ours to make: (what marks them, where).
KNOWN_BUGS: tuple[tuple[tuple[str, ...], str], ...] = ()  # none open


def _known(traceback: str) -> bool:
    return any(all(mark in traceback for mark in marks) for marks, _ in KNOWN_BUGS)


def _tracebacks(log: str) -> list[tuple[str, str]]:
    """(exception line, whole text) of each traceback in a log; chained ones as one."""
    found: list[tuple[str, str]] = []
    lines = log.splitlines()
    i = 0
    while i < len(lines):
        if not lines[i].startswith("Traceback (most recent call last)"):
            i += 1
            continue
        start = i
        while True:
            i += 1  # past a "Traceback" line, then its frames
            while i < len(lines) and (lines[i].startswith(" ") or not lines[i].strip()):
                i += 1
            chained = i + 2 < len(lines) and lines[i + 2].startswith(
                ("During handling", "The above exception")
            )
            if not chained:
                break
            i += 4  # a chained exception: its own "Traceback" line follows
        last = lines[i] if i < len(lines) else "(log ends)"
        found.append((last, "\n".join(lines[start : i + 1])))
        i += 1
    return found


class Mount:
    """A directory for L3 pages: a tmpfs of `size` when mounting works (root), so that it
    can be filled up or remounted read-only mid-run; else a plain directory."""

    def __init__(self, path: Path, size: str) -> None:
        self.path = path
        path.mkdir(parents=True)
        done = subprocess.run(
            # mode=0700: a tmpfs root is 1777, which the file L3 backend refuses (shared).
            ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
            capture_output=True, check=False,
        )  # fmt: skip
        self.is_tmpfs = done.returncode == 0
        self.why_not = done.stderr.decode().strip()

    def remount(self, options: str) -> None:
        assert self.is_tmpfs
        subprocess.run(["mount", "-o", f"remount,{options}", str(self.path)], check=True)

    def unmount(self) -> None:
        if self.is_tmpfs:
            subprocess.run(["umount", "-l", str(self.path)], check=False)
