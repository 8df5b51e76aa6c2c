"""A PD cluster across hosts (netns_hosts.py): mooncake_master, a router, one prefill and
two decode ranks, each on its own host and address. KV moves over the Mooncake Transfer
Engine (tcp) between hosts; decode L3 is the Mooncake Store at the master's host."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from cluster_key import ROUTER_KEY
from fault_load import PAGE_SIZE
from mooncake_fixtures import master_binary
from netns_hosts import Host, HostNet

PORT = 8000  # every host has its own port space: each server takes the same port
MASTER_RPC_PORT, MASTER_HTTP_PORT, MASTER_METRICS_PORT = 50051, 8080, 9003
HOST_NAMES = ("router", "prefill", "decode-0", "decode-1", "master")
RANK_NAMES = ("prefill", "decode-0", "decode-1")
START_TIMEOUT_S = 180.0
PREFILL_ANSWER_TIMEOUT_S = 2.0  # a decode rank gives up on an unreachable prefill rank


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Poll `condition` (exceptions count as False) until it holds; seconds it took."""
    start_s = time.monotonic()
    while True:
        try:
            if condition():
                return time.monotonic() - start_s
        except (httpx.HTTPError, OSError, ValueError, KeyError):
            pass
        if time.monotonic() - start_s > timeout_s:
            raise AssertionError(f"{what}: not reached in {timeout_s} s")
        time.sleep(0.1)


def _accepts(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=0.5):
            return True
    except OSError:
        return False


class Cluster:
    """Starts, watches and stops the processes; `net` removes whatever is left."""

    def __init__(self, net: HostNet, model: Path, logs: Path) -> None:
        self.net, self.model, self.logs = net, model, logs
        self.http = httpx.Client(timeout=10, trust_env=False)
        self.procs: dict[str, Any] = {}

    def url(self, name: str) -> str:
        return self.net[name].url(PORT)

    @property
    def router_url(self) -> str:
        return self.url("router")

    # -- start -----------------------------------------------------------------------

    def start_master(self) -> None:
        binary, host = master_binary(), self.net["master"]
        assert binary is not None
        argv = [
            str(binary),
            f"--rpc_port={MASTER_RPC_PORT}",
            f"--rpc_address={host.address}",
            "--enable_http_metadata_server=true",
            f"--http_metadata_server_port={MASTER_HTTP_PORT}",
            f"--http_metadata_server_host={host.address}",
            f"--metrics_port={MASTER_METRICS_PORT}",
            f"--metrics_host={host.address}",
            "--enable_metric_reporting=false",
        ]
        self.procs["master"] = self.net.spawn(host, argv, self.logs / "master.log")
        ports = (MASTER_RPC_PORT, MASTER_HTTP_PORT)
        wait_for(lambda: all(_accepts(host.address, p) for p in ports), 30, "mooncake_master up")

    def kill_master(self) -> None:
        proc = self.procs["master"]
        proc.kill()
        proc.wait(timeout=10)

    def _store_options(self, host: Host) -> str:
        master = self.net["master"].address
        return json.dumps(
            {
                "master_server_address": f"{master}:{MASTER_RPC_PORT}",
                "metadata_server": f"http://{master}:{MASTER_HTTP_PORT}/metadata",
                "protocol": "tcp",
                "local_hostname": host.address,
                "global_segment_size": 32 << 20,
                "local_buffer_size": 16 << 20,
                "staging_bytes": 4 << 20,
                "timeout_s": 3.0,
                "retry_interval_s": 0.5,
                "setup_timeout_s": 5.0,
            }
        )

    def _rank_argv(self, name: str) -> list[str]:
        host = self.net[name]
        transfer = json.dumps({"local_hostname": host.address, "timeout_s": 2.0})
        argv = [
            sys.executable,
            "-m",
            "kvstrata",
            "serve",
            "--model",
            str(self.model),
            "--host",
            host.address,
            "--port",
            str(PORT),
            "--advertise-url",
            host.url(PORT),
            "--register-with",
            self.router_url,
            "--register-interval-s",
            "0.5",
            "--page-size",
            str(PAGE_SIZE),
            "--max-model-len",
            "256",
            "--log-level",
            "warning",
            "--disaggregation-transfer-backend",
            "mooncake",
            "--disaggregation-mooncake-config",
            transfer,
        ]
        if name == "prefill":
            return [*argv, "--disaggregation-mode", "prefill", "--num-kv-pages", "512"]
        return [
            *argv,
            "--disaggregation-mode",
            "decode",
            "--num-kv-pages",
            "128",
            "--rank",
            name.rsplit("-", 1)[1],
            "--pd-prefill-answer-timeout-s",
            str(PREFILL_ANSWER_TIMEOUT_S),
            # Every prompt crosses to the prefill host, so a heal shows as KV transferred:
            # under auto, once the partition's recomputes taught the rank its own step
            # cost, these 24-token prompts are cheaper here and rightly stay local.
            "--disaggregation-decode-local-prefill",
            "never",
            "--disaggregation-decode-enable-radix-cache",
            "--disaggregation-decode-enable-hicache",
            "--disaggregation-decode-hicache-ratio",
            "0.25",
            "--hicache-storage-backend",
            "mooncake",
            "--hicache-storage-backend-extra-config",
            self._store_options(host),
            "--hicache-storage-prefetch-policy",
            "timeout",
            "--hicache-prefetch-timeout-base-s",
            "1.5",
            "--hicache-prefetch-threshold",
            "8",
        ]

    def start(self) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        self.start_master()
        router_argv = [
            sys.executable,
            "-m",
            "kvstrata",
            "router",
            "--wait-for-registrations",
            "--host",
            self.net["router"].address,
            "--port",
            str(PORT),
            "--load-poll-interval-s",
            "0.2",
            "--load-poll-timeout-s",
            "1",
            "--upstream-timeout-s",
            "30",
            "--log-level",
            "info",
        ]
        self.procs["router"] = self.net.spawn(
            self.net["router"], router_argv, self.logs / "router.log"
        )
        for name in RANK_NAMES:  # started together: they load the model at the same time
            self.procs[name] = self.net.spawn(
                self.net[name], self._rank_argv(name), self.logs / f"{name}.log"
            )
        wait_for(self.whole, START_TIMEOUT_S, "every rank registered, healthy, events live")

    # -- watch -----------------------------------------------------------------------

    def router_ranks(self) -> list[dict[str, Any]]:
        return self.http.get(self.router_url + "/get_load").json()

    def whole(self) -> bool:
        """Every rank answers /health from the test's host, and the router lists every rank
        at its advertised address, healthy, decode ranks with their event stream live."""
        for name in RANK_NAMES:
            self.check_alive(name)
            if self.http.get(self.url(name) + "/health").status_code != 200:
                return False
        ranks = {rank["url"]: rank for rank in self.router_ranks()}
        return set(ranks) == {self.url(n) for n in RANK_NAMES} and all(
            rank["healthy"] and (rank["role"] == "prefill" or rank["events_live"])
            for rank in ranks.values()
        )

    def check_alive(self, name: str) -> None:
        proc = self.procs[name]
        assert proc.poll() is None, f"{name} exited ({proc.returncode}):\n{self.log_tail(name)}"

    def log_tail(self, name: str, num_chars: int = 3000) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")[-num_chars:]

    def invariants(self, name: str) -> dict[str, Any]:
        response = self.http.get(self.url(name) + "/debug/invariants", timeout=30)
        assert response.status_code == 200, f"{name}: {response.text}"
        return response.json()

    def drained(self) -> bool:
        """Nothing in flight anywhere, and every rank's invariants hold."""
        if any(rank["num_inflight"] for rank in self.router_ranks()):
            return False
        for name in RANK_NAMES:
            report = self.invariants(name)
            assert report["ok"], f"{name}: {report['violations']} {report['counts']}"
            if not report["idle"]:
                return False
        return True

    def leaked_pages(self) -> dict[str, int]:
        """Once drained: the KV pages each rank holds that are neither free nor cached
        (pages of requests or rooms no longer there)."""
        leaked = {}
        for name in RANK_NAMES:
            load = self.http.get(self.url(name) + "/get_load").json()
            free_or_cached = load["num_free_pages"] + load["num_cached_pages"]
            leaked[name] = load["num_total_pages"] - free_or_cached + load["num_locked_pages"]
        return leaked

    def generate_via(self, decode: str, prompt: list[int]) -> dict[str, Any]:
        """A greedy /generate sent to `decode` naming the prefill rank (as the router does)."""
        body = {
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
        }
        headers = {"X-Kvstrata-Prefill-Url": self.url("prefill"), **ROUTER_KEY}
        response = self.http.post(
            self.url(decode) + "/generate", json=body, headers=headers, timeout=60
        )
        assert response.status_code == 200, response.text
        return response.json()

    # -- stop ------------------------------------------------------------------------

    def stop(self) -> None:
        """SIGTERM every server (ranks deregister, then drain), then the net kills and
        removes the rest."""
        for name, proc in self.procs.items():
            if name != "master" and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline_s = time.monotonic() + 30
        for name, proc in self.procs.items():
            if name != "master" and proc.poll() is None:
                # One that does not exit in time is killed by the net's close().
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=max(0.1, deadline_s - time.monotonic()))
        self.http.close()
