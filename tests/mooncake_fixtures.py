"""A real `mooncake_master` for tests: `MooncakeMaster` starts one (with its HTTP metadata
server) on free loopback ports, can kill, freeze and restart it, and stops it at the end.
Fixture `mooncake_master`; `require_mooncake()` fails a test when Mooncake is missing."""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack, closing
from pathlib import Path

import pytest

SKIP_ENV = "KVSTRATA_SKIP_MOONCAKE"  # "1" on machines that cannot install Mooncake
_READY_TIMEOUT_S = 20.0


def master_binary() -> Path | None:
    """The mooncake_master executable shipped inside the mooncake wheel, if installed."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        binary = Path(location) / "mooncake_master"
        if binary.is_file():
            return binary
    return None


def require_mooncake() -> None:
    """Mooncake is a test dependency: its absence fails the test, unless $KVSTRATA_SKIP_MOONCAKE
    is 1 (machines whose platform has no Mooncake wheel)."""
    problem = None
    if master_binary() is None:
        problem = "the mooncake package (mooncake-transfer-engine-non-cuda) is not installed"
    else:
        try:
            import mooncake.store  # noqa: F401
        except (ImportError, OSError) as e:  # e.g. libibverbs1 / librdmacm1 missing
            problem = f"mooncake.store does not import: {e}"
    if problem is None:
        return
    if os.environ.get(SKIP_ENV) == "1":
        pytest.skip(f"{problem} ({SKIP_ENV}=1)")
    pytest.fail(f"{problem}; `make install` installs it, or set {SKIP_ENV}=1 to skip")


def free_ports(count: int) -> list[int]:
    """Distinct free loopback ports (held open together so they differ)."""
    with ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(closing(socket.socket()))
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
        return ports


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


class MooncakeMaster:
    """One mooncake_master process. Its ports stay fixed across `restart()` so clients
    configured with `storage_options()` can reconnect."""

    def __init__(self, log_dir: Path) -> None:
        binary = master_binary()
        assert binary is not None, "call require_mooncake() first"
        self.binary = binary
        self.log_path = log_dir / "mooncake_master.log"
        self.rpc_port, self.http_port, self.metrics_port = free_ports(3)
        self.process: subprocess.Popen[bytes] | None = None
        self._started = False  # once started, clients know its ports: they stay

    @property
    def master_address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def storage_options(self, **overrides: object) -> dict[str, object]:
        """Options for `make_storage_backend("mooncake", ...)`, small enough for tests."""
        options: dict[str, object] = {
            "master_server_address": self.master_address,
            "metadata_server": self.metadata_server,
            "protocol": "tcp",
            "local_hostname": "127.0.0.1",
            "global_segment_size": 64 << 20,
            "local_buffer_size": 16 << 20,
            "staging_bytes": 4 << 20,
        }
        options.update(overrides)
        return options

    def start(self) -> None:
        """Start the master and wait until it accepts. Before its first start its ports
        are not promised to anyone yet: if another process took one between `free_ports`
        and the bind, it starts again on new ones (at most three times)."""
        for attempt in range(3):
            try:
                self._start_once()
                self._started = True
                return
            except RuntimeError:
                if self._started or attempt == 2 or "Failed to start" not in self.log_tail():
                    raise
                self.rpc_port, self.http_port, self.metrics_port = free_ports(3)

    def _start_once(self) -> None:
        assert self.process is None or self.process.poll() is not None, "already running"
        command = [
            str(self.binary),
            f"--rpc_port={self.rpc_port}",
            "--rpc_address=127.0.0.1",
            "--enable_http_metadata_server=true",
            f"--http_metadata_server_port={self.http_port}",
            "--http_metadata_server_host=127.0.0.1",
            f"--metrics_port={self.metrics_port}",
            "--metrics_host=127.0.0.1",
            "--enable_metric_reporting=false",
        ]
        with open(self.log_path, "ab") as log_file:
            self.process = subprocess.Popen(
                command, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline_s = time.monotonic() + _READY_TIMEOUT_S
        while not (_accepts(self.rpc_port) and _accepts(self.http_port)):
            if self.process.poll() is not None or time.monotonic() > deadline_s:
                self.stop()
                raise RuntimeError(f"mooncake_master did not start:\n{self.log_tail()}")
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL: the master dies mid-run, as in a crash."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)

    def freeze(self) -> None:
        """SIGSTOP: the master keeps its sockets open but never answers (a hung server)."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)

    def restart(self) -> None:
        self.kill()
        self.start()

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.thaw()
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.kill()

    def log_tail(self, num_chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return "(no log)"


@pytest.fixture
def mooncake_master(tmp_path: Path) -> Iterator[MooncakeMaster]:
    """A running mooncake_master on free loopback ports, stopped after the test."""
    require_mooncake()
    master = MooncakeMaster(tmp_path)
    master.start()
    try:
        yield master
    finally:
        master.kill()  # it holds nothing worth a graceful stop (which takes ~1 s)
