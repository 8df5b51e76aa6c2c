"""`kvstrata launch` owns its --port (issue 27, item 7). A port another process holds (a
plain HTTP server, the router of a running launch) is refused before anything starts, the
message naming --port; a server that takes the port while the ranks start is caught by the
readiness proof: the router must answer GET /launch_proof with the HMAC of the launcher's
challenge under a key the launcher handed it in a 0600 file. Nothing is left running
either way, and a SIGKILLed launcher leaves no child behind."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from starlette.testclient import TestClient

from kvstrata.cluster.child import _free_port
from kvstrata.cluster.port_owner import PortOwner, launch_proof, new_proof_key, router_owner
from kvstrata.config import RouterConfig
from kvstrata.router.launch_proof import make_launch_proof_router

RANK_FLAGS = (
    "--num-prefill", "0", "--num-decode", "1", "--page-size", "16", "--num-kv-pages", "64",
    "--max-model-len", "256", "--log-level", "warning",
)  # fmt: skip
WAIT_S = 240.0
CHILD_LINE = re.compile(r"^(rank \d|router): (http://\S+) \(pid (\d+)")
# What a kvstrata router of a 1-rank cluster answers on /health: enough to pass for ready.
FOREIGN_HEALTH = {"status": "ok", "num_healthy_prefill": 0, "num_prefill": 0,
                  "num_healthy_decode": 1, "num_decode": 1}  # fmt: skip


class _ForeignHandler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        found = self.path == "/health"
        body = json.dumps(FOREIGN_HEALTH if found else {"detail": "Not Found"}).encode()
        self.send_response(200 if found else 404)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


class ForeignServer:
    """Somebody else's server on `port` (0: a free one), answering /health as a router."""

    def __init__(self, port: int = 0) -> None:
        self._server = ThreadingHTTPServer(("127.0.0.1", port), _ForeignHandler)
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@dataclass
class Run:
    proc: subprocess.Popen[str]
    lines: queue.Queue[str | None]
    output: list[str]

    def until(self, done: str) -> list[str]:
        """Output up to a line holding `done`, or to the end (bounded wait)."""
        deadline_s = time.monotonic() + WAIT_S
        while not self.output or done not in self.output[-1]:
            line = self.lines.get(timeout=max(0.0, deadline_s - time.monotonic()))
            if line is None:
                break
            self.output.append(line)
        return self.output

    def pids(self) -> dict[str, int]:
        return {m[1]: int(m[3]) for line in self.output if (m := CHILD_LINE.match(line))}


def launch(model: Path, port: int, log_dir: Path, *flags: str) -> Run:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstrata", "launch", "--model", str(model), "--port", str(port),
         "--log-dir", str(log_dir), *RANK_FLAGS, *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return Run(proc, lines, [])


def is_alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper is not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def leftovers(port: int) -> list[str]:
    """Command lines of kvstrata processes of a launch on `port`: its ranks register with
    http://127.0.0.1:PORT, its router listens on --port PORT."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().decode().split("\0")
        except (OSError, UnicodeDecodeError):
            continue
        if "kvstrata" in argv and (
            any(f"127.0.0.1:{port}" in arg for arg in argv) or argv[-3:-1] == ["--port", str(port)]
        ):  # fmt: skip
            found.append(" ".join(argv))
    return found


def assert_refused(run: Run, port: int, *needles: str, before: tuple[str, ...] = ()) -> str:
    """It exits non-zero naming --port (and `needles`), never ready, and leaves no process
    on `port` but those of `before` (another launch's)."""
    output = "\n".join(run.until("ready: "))
    assert run.proc.wait(timeout=WAIT_S) != 0, output
    assert "ready: " not in output
    for needle in (f"--port {port}", *needles):
        assert needle in output
    deadline_s = time.monotonic() + 60
    while sorted(leftovers(port)) != sorted(before):
        assert time.monotonic() < deadline_s, f"left running: {leftovers(port)}"
        time.sleep(0.1)
    return output


@pytest.fixture(scope="module")
def held(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    """A running launch on a fixed port, with a client API key on its router."""
    tmp = tmp_path_factory.mktemp("held-launch")
    (tmp / "client.key").write_text("client-key-27\n")
    (tmp / "client.key").chmod(0o600)
    run = launch(tiny_llama, _free_port("127.0.0.1"), tmp / "logs", "--api-key-file",
                 str(tmp / "client.key"))  # fmt: skip
    try:
        assert run.until("ready: ")[-1].startswith("ready: "), "\n".join(run.output)
        yield run
    finally:
        if run.proc.poll() is None:
            run.proc.send_signal(signal.SIGTERM)
            run.proc.wait(timeout=120)


def router_of(run: Run) -> tuple[str, int]:
    url = next(m[2] for line in run.output if (m := CHILD_LINE.match(line)) and m[1] == "router")
    return url, int(url.rsplit(":", 1)[1])


def test_the_router_proves_it_is_the_launchs_own(held: Run) -> None:
    url, _ = router_of(held)
    argv = Path(f"/proc/{held.pids()['router']}/cmdline").read_bytes().split(b"\0")
    key_path = Path(argv[argv.index(b"--launch-proof-key-file") + 1].decode())
    key = key_path.read_text().strip()
    assert len(key) >= 32 and stat.S_IMODE(key_path.stat().st_mode) == 0o600
    for entry in Path("/proc").iterdir():  # the key is in no process's argv
        with contextlib.suppress(OSError):
            assert key.encode() not in (entry / "cmdline").read_bytes(), entry
    assert router_owner(url, key, 5.0) is PortOwner.CHILD
    assert router_owner(url, new_proof_key(), 5.0) is PortOwner.OTHER
    # Public (the router wants an API key everywhere else): the answer reveals no key.
    assert httpx.get(url + "/v1/models", timeout=10).status_code == 401
    challenge = os.urandom(16).hex()
    answer = httpx.get(url + "/launch_proof", params={"challenge": challenge}, timeout=10)
    assert answer.status_code == 200 and answer.json() == {"proof": launch_proof(key, challenge)}
    bad = httpx.get(url + "/launch_proof", params={"challenge": "not hex"}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "challenge"
    # A router nobody launched has nothing to prove.
    app = FastAPI()
    app.include_router(make_launch_proof_router(RouterConfig(decode=("http://127.0.0.1:2",))))
    unlaunched = TestClient(app).get("/launch_proof", params={"challenge": challenge})
    assert unlaunched.status_code == 404
    assert unlaunched.json()["error"]["code"] == "no_launch_proof"


def test_a_second_launch_on_the_port_of_a_running_one_is_refused(
    held: Run, tiny_llama: Path, tmp_path: Path
) -> None:
    url, port = router_of(held)
    first = tuple(leftovers(port))
    assert len(first) == 2  # its rank and its router
    second = launch(tiny_llama, port, tmp_path / "logs")
    assert_refused(second, port, "already in use by another process", before=first)
    assert not list((tmp_path / "logs").glob("*.log"))  # nothing was started
    assert httpx.get(url + "/health", timeout=10).status_code == 200  # the first one serves


def test_a_plain_http_server_on_the_port_is_refused(tiny_llama: Path, tmp_path: Path) -> None:
    foreign = ForeignServer()
    try:
        run = launch(tiny_llama, foreign.port, tmp_path / "logs")
        assert_refused(run, foreign.port, "already in use by another process")
    finally:
        foreign.close()


def test_a_server_taking_the_port_while_the_ranks_start_is_caught(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """Past the bind check: only the proof tells the foreign server from the router."""
    port = _free_port("127.0.0.1")
    run = launch(tiny_llama, port, tmp_path / "logs")
    deadline_s = time.monotonic() + WAIT_S
    while not (tmp_path / "logs" / "rank-0.log").exists():  # the port was checked by then
        assert run.proc.poll() is None and time.monotonic() < deadline_s, run.until("ready: ")
        time.sleep(0.01)
    foreign = ForeignServer(port)
    try:
        output = assert_refused(run, port)
        assert "served by another process" in output or "in use by another process" in output
    finally:
        foreign.close()


def test_a_sigkilled_launcher_leaves_no_child(held: Run) -> None:
    """Last: it kills the module's launch. Its children die with it (PR_SET_PDEATHSIG)."""
    pids = held.pids()
    assert sorted(pids) == ["rank 0", "router"] and all(map(is_alive, pids.values()))
    held.proc.kill()
    held.proc.wait(timeout=30)
    deadline_s = time.monotonic() + 60
    while alive := [name for name, pid in pids.items() if is_alive(pid)]:
        assert time.monotonic() < deadline_s, f"still running after the launcher died: {alive}"
        time.sleep(0.1)
