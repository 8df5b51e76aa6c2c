"""`kvstrata launch` and `launch_cluster`: a local cluster (its shape: `launch_config.py`)
of routers, prefill ranks and decode ranks as child processes on free loopback ports (the
ranks register with every router), waited for until healthy and restarted when one exits
(`supervisor.py`); stopping sends SIGTERM, then SIGKILL. Keys reach the children through
0600 files in a private directory, never through their argv. A --port in use is refused
before anything starts, and the router counts as up only once it proves it is this
launch's own."""

from __future__ import annotations

import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

from kvstrata.cluster.child import Child, _free_port
from kvstrata.cluster.cluster_start import (
    ClusterStartError,
    check_port_free,
    wait_healthy,
    wait_own_routers,
    wait_registered,
)
from kvstrata.cluster.key_files import KeyFiles
from kvstrata.cluster.launch_config import (
    LAUNCHER_RANK_FLAGS,
    LAUNCHER_ROUTER_FIELDS,
    LaunchConfig,
)
from kvstrata.cluster.port_owner import new_proof_key
from kvstrata.cluster.rank_flags import split_rank_flags
from kvstrata.cluster.supervisor import RestartPolicy, Supervisor
from kvstrata.config import ConfigError, RouterConfig, ServerConfig, flag, to_argv
from kvstrata.config.options import warn_secrets_in_argv

# A restarted router learns the ranks back within this time (they register again).
REGISTER_INTERVAL_S = 2.0
_POLL_S = 0.2


def _names(arg: str, name: str) -> bool:
    """Whether the command-line word `arg` is the flag of field `name`."""
    return arg == flag(name) or arg.startswith(flag(name) + "=")


def rank_device_groups(devices: Sequence[str], config: LaunchConfig, tp_size: int) -> list[str]:
    """Each rank's --device from --rank-devices: the first of its `tp_size` devices, which
    must be consecutive CUDA indexes (a TP rank's workers take --device's index and the
    next ones). Raises ConfigError naming the flag."""
    if not devices:
        return []
    num_ranks = config.num_prefill + config.num_decode
    if len(devices) != num_ranks * tp_size:
        raise ConfigError(
            f"--rank-devices needs {tp_size} device(s) per rank for {num_ranks} ranks "
            f"(--tp-size {tp_size}): {num_ranks * tp_size}, got {len(devices)}"
        )
    firsts = []
    for start in range(0, len(devices), tp_size):
        group = list(devices[start : start + tp_size])
        first = group[0].removeprefix("cuda:") if group[0].startswith("cuda:") else "0"
        wanted = [f"cuda:{int(first) + i}" for i in range(tp_size)] if first.isdigit() else []
        if tp_size > 1 and group != wanted:
            raise ConfigError(
                f"--rank-devices: a TP rank's devices must be consecutive CUDA indexes "
                f"({' '.join(wanted)}), got {' '.join(devices[start : start + tp_size])}"
            )
        firsts.append(devices[start])
    return firsts


class Cluster:
    """The running children. Use as a context manager, or call `stop()`."""

    def __init__(
        self,
        log_dir: Path,
        stop_grace_s: float,
        api_key: str | None,
        rank_api_key: str | None = None,
    ) -> None:
        self.log_dir = log_dir
        self.stop_grace_s = stop_grace_s
        self.api_key = api_key  # what clients of the router need, if set
        self.rank_api_key = rank_api_key  # what the ranks accept (the router sends it)
        # What ranks and the router of this cluster prove they belong with (always: the
        # rank-to-rank endpoints refuse callers without it, whether or not --api-key is set).
        self.cluster_key = secrets.token_urlsafe(32)
        # What the routers prove they hold (`port_owner.py`), so that another server on a
        # router's port is never taken for this cluster's router.
        self.proof_key = new_proof_key()
        self.key_files = KeyFiles()
        self.router_key_argv: list[str] = []  # the router's key flags (for extra routers)
        self.prefill: list[Child] = []
        self.decode: list[Child] = []  # unified ranks when there are no prefill ranks
        self.routers: list[Child] = []
        self._stopped = False

    @property
    def children(self) -> list[Child]:
        return self.prefill + self.decode + self.routers

    @property
    def router(self) -> Child | None:
        """The first router (the one on --port)."""
        return self.routers[0] if self.routers else None

    @property
    def router_url(self) -> str:
        assert self.router is not None, "the router is not started"
        return self.router.url

    @property
    def router_urls(self) -> list[str]:
        return [child.url for child in self.routers]

    @property
    def prefill_urls(self) -> list[str]:
        return [child.url for child in self.prefill]

    @property
    def decode_urls(self) -> list[str]:
        return [child.url for child in self.decode]

    def stop(self) -> None:
        """SIGTERM every child (the router first: nothing new reaches the ranks), wait up
        to `stop_grace_s` in all, then SIGKILL whatever is left. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        procs = [child.proc for child in reversed(self.children) if child.proc is not None]
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline_s = time.monotonic() + self.stop_grace_s
        for proc in procs:
            try:
                proc.wait(timeout=max(0.0, deadline_s - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.key_files.remove()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def launch_cluster(
    config: LaunchConfig,
    rank_args: Sequence[str] = (),
    router_options: Mapping[str, Any] | None = None,
) -> Cluster:
    """Start `config.num_routers` routers (`router_options`: RouterConfig fields), then
    `config.num_prefill` prefill and `config.num_decode` decode ranks (each with
    `rank_args`, split by role) that register with every router, and wait until every
    router sees every rank healthy. Raises ConfigError before anything starts, or
    ClusterStartError after stopping everything that was started."""
    options = dict(router_options or {})
    bad = [name for name in options if name in LAUNCHER_ROUTER_FIELDS]
    if bad:
        raise ConfigError(f"{flag(bad[0])} is set by kvstrata launch; drop it")
    taken = next((f for f in rank_args for name in LAUNCHER_RANK_FLAGS if _names(f, name)), None)
    if taken is not None:
        raise ConfigError(f"{taken.split('=')[0]} is set by kvstrata launch; drop it")
    rank_flags = split_rank_flags(config.model, rank_args, config.num_prefill, options)
    if config.rank_devices and any(_names(f, "device") for f in rank_args):
        raise ConfigError("give either --rank-devices or the rank flag --device, not both")
    devices = iter(rank_device_groups(config.rank_devices, config, rank_flags.tp_size))
    client_key = _check_router_options(options, has_prefill=config.num_prefill > 0).api_key
    if config.port:
        check_port_free(config.host, config.port)
    log_dir = Path(config.log_dir or tempfile.mkdtemp(prefix="kvstrata-launch-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    # A client key guards the router; the ranks get another one, known only to the router
    # and to each other, so holding the client key does not reach a rank directly.
    rank_key = rank_flags.api_key
    if rank_key is None and client_key is not None:
        rank_key = secrets.token_urlsafe(24)
    cluster = Cluster(log_dir, config.stop_grace_s, client_key, rank_key)
    deadline_s = time.monotonic() + config.startup_timeout_s
    pd = config.num_prefill > 0
    try:
        rank_key_argv, router_key_argv = _hand_out_keys(cluster, options)
        proof_key_path = cluster.key_files.write("launch-proof.key", cluster.proof_key)
        router_argv = [
            "router",
            "--wait-for-registrations",
            "--host",
            config.host,
            "--model",
            config.model,
            *to_argv(options),
            *router_key_argv,
            "--launch-proof-key-file",
            str(proof_key_path),
        ]
        # The routers' ports are fixed before the ranks start: the ranks register with
        # them (retrying until they listen), and a restarted router keeps its port.
        url_host = "127.0.0.1" if config.host in ("0.0.0.0", "::", "") else config.host
        router_urls = []
        for index in range(config.num_routers):
            name = "router" if index == 0 else f"router {index}"
            log_path = log_dir / f"{name.replace(' ', '-')}.log"
            port = (config.port if index == 0 else 0) or _free_port(config.host)
            cluster.routers.append(
                Child(name, router_argv, config.host, log_path, port, cluster.proof_key)
            )
            router_urls.append(f"http://{url_host}:{port}")
        register_argv = [
            "--register-with",
            ",".join(router_urls),
            "--register-interval-s",
            str(REGISTER_INTERVAL_S),
        ]
        roles = [
            (
                "prefill",
                "prefill",
                config.num_prefill,
                rank_flags.prefill + rank_key_argv,
                cluster.prefill,
            ),
            (
                "decode" if pd else "null",
                "decode" if pd else "",
                config.num_decode,
                rank_flags.decode + rank_key_argv,
                cluster.decode,
            ),
        ]
        for mode, label, count, argv, children in roles:
            for index in range(count):
                name = f"{label} rank {index}".lstrip()
                serve = [
                    "serve",
                    "--model",
                    config.model,
                    "--host",
                    "127.0.0.1",
                    "--rank",
                    str(index),
                    "--disaggregation-mode",
                    mode,
                    *argv,
                    *register_argv,
                ]
                if config.rank_devices:
                    serve += ["--device", next(devices)]
                log_path = log_dir / f"{name.replace(' ', '-')}.log"
                children.append(Child(name, serve, "127.0.0.1", log_path, fixed_port=0))
                children[-1].start()
        wait_healthy(cluster.prefill + cluster.decode, deadline_s)
        for router in cluster.routers:
            router.start()
        wait_own_routers(cluster.routers, deadline_s)
        wait_registered(cluster.routers, (config.num_prefill, config.num_decode), deadline_s)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _hand_out_keys(cluster: Cluster, options: dict[str, Any]) -> tuple[tuple[str, ...], list[str]]:
    """The flags that give the ranks and the router their keys as files: the cluster key
    always, the rank key if there is one (a client key given as a value is taken out of
    `options` and written to one too)."""
    cluster_key_path = str(cluster.key_files.write("cluster.key", cluster.cluster_key))
    rank_argv: tuple[str, ...] = ("--cluster-key-file", cluster_key_path)
    router_argv: list[str] = ["--cluster-key-file", cluster_key_path]
    if cluster.rank_api_key is not None:
        rank_key_path = str(cluster.key_files.write("rank.key", cluster.rank_api_key))
        rank_argv += ("--api-key-file", rank_key_path)
        router_argv += ["--rank-api-key-file", rank_key_path]
    if options.get("api_key") is not None:
        client_key_path = cluster.key_files.write("client.key", options.pop("api_key"))
        router_argv += ["--api-key-file", str(client_key_path)]
    cluster.router_key_argv = list(router_argv)
    return rank_argv, router_argv


def _check_router_options(options: Mapping[str, Any], has_prefill: bool) -> RouterConfig:
    """Refuse bad router options before any child starts (and read a key file). The ranks'
    ports are not known yet, so stand-in URLs take their place (RouterConfig needs some)."""
    stand_in_prefill = ("http://127.0.0.1:1",) if has_prefill else ()
    return RouterConfig(prefill=stand_in_prefill, decode=("http://127.0.0.1:2",), **options)


class _StopRequested(Exception):
    """SIGTERM or SIGINT reached the launcher."""


def run_launch(
    config: LaunchConfig, rank_args: Sequence[str], router_options: Mapping[str, Any]
) -> int:
    """`kvstrata launch`: start the cluster, print its URLs, and run until a signal (stop
    everything, exit 0) or until a child exits that is not restarted (--no-restart, or
    out of restarts: print its log tail, stop, exit 1)."""
    warn_secrets_in_argv(RouterConfig, router_options)
    if any(_names(arg, "api_key") for arg in rank_args):
        warn_secrets_in_argv(ServerConfig, {"api_key": "given"})
    stopping = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if not stopping.is_set():  # later signals must not interrupt the stop itself
            stopping.set()
            raise _StopRequested

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    try:
        with launch_cluster(config, rank_args, router_options) as cluster:
            print(f"kvstrata launch: logs in {cluster.log_dir}", flush=True)
            for child in cluster.children:
                assert child.proc is not None
                print(f"{child.name}: {child.url} (pid {child.proc.pid}, log {child.log_path})")
            routers = " ".join(cluster.router_urls)  # the first is on --port
            print(f"ready: {routers} (Ctrl-C stops the cluster)", flush=True)
            supervisor = Supervisor(
                cluster,
                RestartPolicy(
                    config.restart,
                    config.restart_backoff_s,
                    max_restarts=config.max_restarts,
                    window_s=config.restart_window_s,
                ),
            )
            while (dead := supervisor.poll()) is None:
                time.sleep(_POLL_S)
            stopping.set()
            print(
                f"kvstrata launch: {dead.name} exited with status {dead.exit_code}; stopping "
                f"the cluster. Log {dead.log_path}:\n{dead.log_tail()}",
                file=sys.stderr,
                flush=True,
            )
            return 1
    except _StopRequested:
        print("kvstrata launch: stopped every child", flush=True)
        return 0
    except ClusterStartError as e:
        print(f"kvstrata launch: {e}", file=sys.stderr, flush=True)
        return 1
