"""`Child`: one process of a launched cluster (a rank or the router) started as
`python -m kvstrata ARGV --port P` in a session of its own that dies with the launcher,
restartable on the same port, with its log file."""

from __future__ import annotations

import ctypes
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=_die_with_parent,
            )  # fmt: skip
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

    def lost_port_race(self) -> bool:
        """It exited because its free port was taken meanwhile: worth another start."""
        log = self.log_path.read_text(errors="replace").lower()
        return not self.fixed_port and self.num_starts < _PORT_ATTEMPTS and (
            "address already in use" in log
        )  # fmt: skip

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


def _die_with_parent() -> None:
    # In the child before exec: SIGTERM when the launcher dies, even by SIGKILL, so no
    # rank outlives it. Tied to the launching thread: launch from a long-lived one.
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)
