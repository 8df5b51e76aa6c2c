"""Hosts on one box: one network namespace per host, each joined to a Linux bridge in the
root namespace by a veth pair and given its own 10.77.N.x/24 address; processes run inside
with `ip netns exec`. Owns every namespace, link and process it makes, and removes them."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

PREFIX = "kvsn"  # every namespace and link made here is named PREFIX + owner pid (hex) + ...
# A MAC no interface has: a static neighbour entry to it makes a host's packets to one
# peer vanish on the bridge (a silent partition, without iptables or tc).
NOWHERE_MAC = "02:6b:76:00:00:01"
_GONE_TIMEOUT_S = 10.0


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def netns_unavailable() -> str | None:
    """Why this box cannot build hosts (a skip reason), or None when it can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is missing"
    probe = f"{PREFIX}{os.getpid():06x}probe"
    made = ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed (no CAP_NET_ADMIN?): {made.stderr.strip()}"
    ip("netns", "del", probe, check=False)
    bridge = ip("link", "add", probe[:15], "type", "bridge", check=False)
    if bridge.returncode != 0:
        return f"`ip link add type bridge` failed: {bridge.stderr.strip()}"
    ip("link", "del", probe[:15], check=False)
    return None


@dataclass(frozen=True)
class Host:
    name: str  # "router", "prefill", "decode-0", ...
    netns: str
    address: str  # its IPv4 address on the bridge
    veth: str  # the root-side end of its link: down, the host is cut off

    def url(self, port: int) -> str:
        return f"http://{self.address}:{port}"


def _pid_alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def _ns_pids(netns: str) -> list[int]:
    listed = ip("netns", "pids", netns, check=False).stdout.split()
    return [int(pid) for pid in listed if pid.isdigit()]


def _kill_and_delete_netns(netns: str) -> None:
    """SIGKILL what still runs in `netns`, wait until it is gone, then delete the name."""
    pids = _ns_pids(netns)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline_s = time.monotonic() + _GONE_TIMEOUT_S
    while any(_pid_alive(pid) for pid in pids) and time.monotonic() < deadline_s:
        time.sleep(0.05)
    ip("netns", "del", netns, check=False)


def sweep_leftovers() -> list[str]:
    """Removes the namespaces and links of earlier runs whose owner process is dead (a
    SIGKILLed pytest cannot clean up); returns their names."""
    names = [line.split()[0] for line in ip("netns", "list").stdout.splitlines() if line]
    links = [
        line.split()[1].rstrip(":").split("@")[0]
        for line in ip("-o", "link", "show").stdout.splitlines()
    ]
    swept = []
    for name in [*names, *links]:
        owner = name[len(PREFIX) : len(PREFIX) + 6]
        if not name.startswith(PREFIX) or len(owner) < 6:
            continue
        try:
            if _pid_alive(int(owner, 16)):
                continue
        except ValueError:
            continue
        if name in names:
            _kill_and_delete_netns(name)
        else:
            ip("link", "del", name, check=False)
        swept.append(name)
    return swept


def _free_subnet() -> int:
    """A third octet N such that no address of the root namespace is in 10.77.N.0/24."""
    used = ip("-o", "-4", "addr", "show").stdout
    for offset in range(254):
        octet = (os.getpid() + offset) % 254 + 1
        if f" 10.77.{octet}." not in used:
            return octet
    raise RuntimeError("no free 10.77.N.0/24 subnet")


class HostNet:
    """The bridge and the hosts. The root namespace holds 10.77.N.1 on the bridge, so the
    test process reaches every host; hosts are .10, .11, ... in the order named."""

    def __init__(self, names: Sequence[str]) -> None:
        sweep_leftovers()
        self.tag = f"{PREFIX}{os.getpid():06x}{int(time.time() * 10) % 16:x}"  # 11 chars
        self.bridge = f"{self.tag}br"
        self.subnet = f"10.77.{_free_subnet()}"
        self.hosts: dict[str, Host] = {}
        self.procs: list[subprocess.Popen[bytes]] = []
        try:
            ip("link", "add", self.bridge, "type", "bridge")
            ip("addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
            ip("link", "set", self.bridge, "up")
            for index, name in enumerate(names):
                self._add_host(name, index)
        except BaseException:
            self.close()
            raise

    def _add_host(self, name: str, index: int) -> None:
        address = f"{self.subnet}.{10 + index}"
        host = Host(name, f"{self.tag}-{name}", address, f"{self.tag}v{index}")
        self.hosts[name] = host
        ip("netns", "add", host.netns)
        peer = f"{host.veth}p"
        ip("link", "add", host.veth, "type", "veth", "peer", "name", peer)
        ip("link", "set", peer, "netns", host.netns)
        ip("link", "set", host.veth, "master", self.bridge, "up")
        inside = ("-n", host.netns)
        ip(*inside, "link", "set", peer, "name", "eth0")
        ip(*inside, "addr", "add", f"{host.address}/24", "dev", "eth0")
        ip(*inside, "link", "set", "eth0", "up")
        ip(*inside, "link", "set", "lo", "up")

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def spawn(self, host: Host, argv: Sequence[str], log_path: Path) -> subprocess.Popen[bytes]:
        """Start `argv` inside `host` (`ip netns exec` execs it: the pid is the process's)."""
        with log_path.open("ab") as log:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", host.netns, *argv], stdout=log, stderr=subprocess.STDOUT
            )
        self.procs.append(proc)
        return proc

    # -- faults --------------------------------------------------------------------

    def set_link(self, host: Host, up: bool) -> None:
        """The host's cable: down, nothing reaches it and it reaches nothing."""
        ip("link", "set", host.veth, "up" if up else "down")

    def partition(self, a: Host, b: Host) -> None:
        """Packets between `a` and `b` are dropped silently, both ways; others flow."""
        for src, dst in ((a, b), (b, a)):
            ip(
                "-n",
                src.netns,
                "neigh",
                "replace",
                dst.address,
                "lladdr",
                NOWHERE_MAC,
                "nud",
                "permanent",
                "dev",
                "eth0",
            )

    def heal(self, a: Host, b: Host) -> None:
        for src, dst in ((a, b), (b, a)):
            ip("-n", src.netns, "neigh", "del", dst.address, "dev", "eth0", check=False)

    # -- cleanup -------------------------------------------------------------------

    def close(self) -> None:
        """Kill every process started here (and any other left in a namespace), then
        delete the namespaces, the veths and the bridge. Idempotent; never raises."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=_GONE_TIMEOUT_S)
        for host in self.hosts.values():
            _kill_and_delete_netns(host.netns)
            ip("link", "del", host.veth, check=False)
        ip("link", "del", self.bridge, check=False)

    def leftovers(self) -> list[str]:
        """Names of this net still present (empty after close())."""
        present = ip("netns", "list").stdout + ip("-o", "link", "show").stdout
        names = [self.bridge, *(h.netns for h in self.hosts.values())]
        names += [h.veth for h in self.hosts.values()]
        return [name for name in names if name in present]

    def __enter__(self) -> HostNet:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
