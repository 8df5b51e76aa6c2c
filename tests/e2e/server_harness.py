"""Helpers of the end-to-end tests: real `kvstrata serve` processes on free loopback
ports (started, waited for on /health, stopped), SSE parsing, and the idle-rank check."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

MODEL_NAME = "tiny"
PAGE_SIZE = 16
MAX_MODEL_LEN = 1024
NUM_KV_PAGES = 512
MAX_BODY_BYTES = 1_000_000
# The flags of the shared server; the `llm` fixtures mirror the engine ones for parity checks.
SERVER_FLAGS = (
    "--served-model-name", MODEL_NAME, "--page-size", str(PAGE_SIZE),
    "--max-model-len", str(MAX_MODEL_LEN), "--num-kv-pages", str(NUM_KV_PAGES),
    "--max-body-bytes", str(MAX_BODY_BYTES), "--log-level", "warning",
)  # fmt: skip
STARTUP_TIMEOUT_S = 180.0


@dataclass
class ServerProcess:
    proc: subprocess.Popen[bytes]
    base_url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        """SIGTERM, then SIGKILL if it does not exit; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn(log_path: Path, port: int, *argv: str) -> ServerProcess:
    """Start `python -m kvstrata ARGV --port PORT` (a rank or a router) without waiting."""
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvstrata", *argv, "--port", str(port)],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    return ServerProcess(proc, f"http://127.0.0.1:{port}", log_path)


def start_server(model: Path, log_dir: Path, *flags: str) -> ServerProcess:
    """Start `python -m kvstrata serve` and wait until /health answers 200."""
    log_dir.mkdir(parents=True, exist_ok=True)
    for attempt in range(3):  # another process may take the free port before we bind it
        port = _free_port()
        log_path = log_dir / f"server-{port}.log"
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "kvstrata", "serve", "--model", str(model),
                 "--port", str(port), *flags],
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        server = ServerProcess(proc, f"http://127.0.0.1:{port}", log_path)
        if _wait_healthy(server):
            return server
        server.stop()
        if "address already in use" not in server.log().lower() or attempt == 2:
            raise RuntimeError(f"the server did not start:\n{server.log()}")
    raise AssertionError("unreachable")


def _wait_healthy(server: ServerProcess) -> bool:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            return False
        try:
            if httpx.get(server.base_url + "/health", timeout=5).status_code == 200:
                return True
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    return False


def sse_events(response: httpx.Response) -> Iterator[str]:
    """The `data:` payloads of a server-sent event stream, in order."""
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield line[len("data: ") :]


def assert_idle(http: httpx.Client) -> None:
    """No request runs or waits, and every KV page is free or cached (none leaked)."""
    load = http.get("/get_load").json()
    assert load["num_running_reqs"] == 0
    assert load["num_waiting_reqs"] == 0
    assert load["num_used_pages"] == 0
    assert load["num_free_pages"] + load["num_cached_pages"] == load["num_total_pages"]


def wait_until(
    http: httpx.Client, condition: Callable[[dict[str, Any]], bool], timeout_s: float = 60.0
) -> None:
    """Poll /get_load until `condition(load)` holds (bounded; fails if it never does)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition(http.get("/get_load").json()):
            return
        time.sleep(0.005)
    raise AssertionError(f"/get_load never satisfied the condition in {timeout_s} s")


def wait_until_idle(http: httpx.Client) -> None:
    """Wait for in-flight requests to end, e.g. after their client went away."""
    wait_until(http, lambda load: load["num_running_reqs"] == load["num_waiting_reqs"] == 0)
