"""Who serves a launched child's port: a bind check before a launch starts anything, the
router's launch proof (an HMAC of the launcher's challenge under a key only the launcher
and its router hold), and, for ranks, whether the child's own process holds the listening
socket (Linux /proc). A server that answers on the port is not proof that it is ours."""

from __future__ import annotations

import enum
import errno
import hmac
import os
import secrets
import socket
from pathlib import Path

import httpx

from kvstrata.http.launch_proof import LAUNCH_PROOF_PATH, launch_proof

_LISTEN_STATE = "0A"  # TCP_LISTEN in /proc/net/tcp


class PortOwner(enum.Enum):
    """What answers on a child's port."""

    CHILD = "child"  # the child itself
    OTHER = "other"  # some other process
    NOBODY = "nobody"  # nothing listens, or nothing answered (yet)


def port_in_use(host: str, port: int) -> bool:
    """Whether another socket holds `port` on `host` (as uvicorn binds: with SO_REUSEADDR,
    so connections left in TIME_WAIT by a stopped server do not count)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return True
            raise
    return False


def new_proof_key() -> str:
    return secrets.token_urlsafe(32)


def router_owner(url: str, proof_key: str, timeout_s: float) -> PortOwner:
    """Ask whatever answers at `url` for the proof of `proof_key`, with a fresh challenge
    (so an answer cannot be replayed); the key itself never leaves this process."""
    challenge = secrets.token_hex(16)
    try:
        response = httpx.get(
            url + LAUNCH_PROOF_PATH, params={"challenge": challenge}, timeout=timeout_s
        )
    except httpx.TransportError:
        return PortOwner.NOBODY
    try:
        proof = response.json().get("proof") if response.status_code == 200 else None
    except (ValueError, AttributeError):  # not JSON, or not an object: not our router
        proof = None
    if isinstance(proof, str) and hmac.compare_digest(proof, launch_proof(proof_key, challenge)):
        return PortOwner.CHILD
    return PortOwner.OTHER


def process_owner(pid: int, port: int) -> PortOwner | None:
    """Whether process `pid` holds the socket listening on TCP `port` (CHILD), another
    process does (OTHER) or none does (NOBODY), read from /proc in `pid`'s network
    namespace; None where /proc cannot tell (not Linux, or the process is gone)."""
    inodes: set[str] = set()
    for table in ("tcp", "tcp6"):
        try:
            rows = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()  # sl local_address rem_address st ... inode
            if fields[3] == _LISTEN_STATE and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    if not inodes:
        return PortOwner.NOBODY
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:[") and target[len("socket:[") : -1] in inodes:
            return PortOwner.CHILD
    return PortOwner.OTHER
