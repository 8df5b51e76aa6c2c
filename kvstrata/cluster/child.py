"""`Child`: one process of a launched cluster (a rank or the router) started as
`python -m kvstrata ARGV --port P` in a session of its own that dies with the launcher
(even by SIGKILL), restartable on the same port, with its log file; whether what answers
on its port is the child itself (`port_owner.py`)."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvstrata.cluster.port_owner import PortOwner, process_owner, router_owner

_PORT_ATTEMPTS = 3  # another process may take a free port before the child binds it
_LOG_TAIL_LINES = 30


@dataclass
class Child:
    """One child process: a rank or the router (`python -m kvstrata ARGV --port P`)."""

    name: str  # "prefill rank 0", "decode rank 1", "router"
    argv: list[str]  # the sub-command and its flags, without --port
    host: str
    log_path: Path
    fixed_port: int  # 0: a free port, chosen again if another process takes it first
    # A router's launch proof key (its --launch-proof-key-file holds it); None: a rank.
    proof_key: str | None = None
    # What the child gets when the process that started it dies (SIGKILL for one that
    # may be frozen: a stopped process never acts on SIGTERM).
    death_signal: int = signal.SIGTERM
    url: str = ""
    port: int = 0  # the port of the last start; a restart keeps it (the router's URL)
    proc: subprocess.Popen[bytes] | None = None
    num_starts: int = 0

    def start(self, port: int = 0, log_mode: str = "wb") -> None:
        port = port or self.fixed_port or _free_port(self.host)
        self.port = port
        with self.log_path.open(log_mode) as log:
            # A session of its own: a terminal's Ctrl-C reaches only the launcher, which
            # then stops each child once, gracefully.
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvstrata", *self.argv, "--port", str(port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=functools.partial(die_with_parent, self.death_signal, os.getpid()),
            )
        url_host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        self.url = f"http://{url_host}:{port}"
        self.num_starts += 1

    def restart(self) -> None:
        """Start again on the same port, appending to the same log."""
        with self.log_path.open("ab") as log:
            log.write(b"\n----- kvstrata launch: restarted -----\n")
        self.start(self.port, log_mode="ab")

    @property
    def exit_code(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None

    def owner(self, timeout_s: float = 1.0) -> PortOwner:
        """Who answers on the child's port: a router must prove it holds `proof_key`; a
        rank's own process must hold the listening socket (where /proc cannot tell, a
        rank that answers is taken at its word, as before)."""
        if self.proof_key is not None:
            return router_owner(self.url, self.proof_key, timeout_s)
        if self.proc is not None:
            owner = process_owner(self.proc.pid, self.port)
            if owner is not None:
                return owner
        return PortOwner.CHILD

    def is_healthy(self, timeout_s: float = 1.0) -> bool:
        """/health answers 200 on the child's port, and the answer is the child's own."""
        with contextlib.suppress(httpx.TransportError):
            healthy = httpx.get(self.url + "/health", timeout=timeout_s).status_code == 200
            return healthy and self.owner(timeout_s) is PortOwner.CHILD
        return False

    def port_taken(self) -> bool:
        """Its log says its port was in use when it tried to listen."""
        return "address already in use" in self.log_path.read_text(errors="replace").lower()

    def lost_port_race(self) -> bool:
        """It exited because its free port was taken meanwhile: worth another start."""
        return not self.fixed_port and self.num_starts < _PORT_ATTEMPTS and self.port_taken()

    def log_tail(self, num_lines: int = _LOG_TAIL_LINES) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(f"  | {line}" for line in lines[-num_lines:])


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _load_prctl() -> Any:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl  # Linux only
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl()  # resolved here: the child between fork and exec only calls it
_PR_SET_PDEATHSIG = 1


def die_with_parent(death_signal: int = signal.SIGTERM, parent_pid: int | None = None) -> None:
    """A `preexec_fn`: in the child before exec, ask for `death_signal` when the parent
    dies, even by SIGKILL, so no child outlives it (Linux; elsewhere nothing). Tied to
    the thread that started the child: start children from a long-lived one. With
    `parent_pid` (the starter's pid, taken before the fork), a parent that died before
    the request took effect is caught too."""
    if _PRCTL is None:
        return
    _PRCTL(_PR_SET_PDEATHSIG, death_signal)
    if parent_pid is not None and os.getppid() != parent_pid:
        os.kill(os.getpid(), death_signal)
