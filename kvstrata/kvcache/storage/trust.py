"""Who may write the L3 pages a rank reads: `L3Trust` (the page MAC key, the `file`
backend's file modes and shared-directory switch), the key derivation from a secret (an
L3 key file's, or the cluster key), and the per-process key used when there is none."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
from dataclasses import dataclass, field

# Domain separation: the cluster key is also a bearer token between ranks; the bytes
# that key the page MACs are never the bytes sent in a header.
_MAC_KEY_LABEL = b"kvstrata l3 page mac v1"
_process_key_lock = threading.Lock()
_process_key: bytes | None = None


def mac_key_from_secret(secret: str) -> bytes:
    """The page MAC key of a secret: HMAC-SHA256(secret, label). Equal secrets give equal
    keys, so every rank given the same key file or cluster key reads the others' pages."""
    if not secret:
        raise ValueError("an L3 key secret must not be empty")
    return hmac.new(secret.encode(), _MAC_KEY_LABEL, hashlib.sha256).digest()


def process_mac_key() -> bytes:
    """A random key made once per process: pages it signs are readable by this process
    only (every backend of the process shares it)."""
    global _process_key
    with _process_key_lock:
        if _process_key is None:
            _process_key = secrets.token_bytes(32)
        return _process_key


@dataclass(frozen=True)
class FileModes:
    """The modes the `file` backend gives what it creates, and what it accepts of others."""

    file_mode: int  # page files and the directory's key file
    dir_mode: int  # the directory and its fan-out subdirectories
    group_shares: bool  # members of the directory's group may own and write it


FILE_MODES = {
    # One user's processes share pages; nobody else can read, list or write them.
    "private": FileModes(0o600, 0o700, group_shares=False),
    # Ranks of several users of one group share a directory: the group reads and writes
    # (setgid: new files get the directory's group); others get nothing.
    "group": FileModes(0o640, 0o2770, group_shares=True),
}


@dataclass(frozen=True)
class L3Trust:
    """What a backend trusts. `mac_key` None: the backend's own key (`file`: the key
    file in its directory; `mooncake`: `process_mac_key()`). `file_mode` is a key of
    FILE_MODES; `allow_shared_dir` accepts a directory others own or may write."""

    mac_key: bytes | None = field(default=None, repr=False)  # never printed
    file_mode: str = "private"
    allow_shared_dir: bool = False

    def __post_init__(self) -> None:
        if self.file_mode not in FILE_MODES:
            raise ValueError(
                f"--hicache-storage-file-mode must be one of {', '.join(FILE_MODES)}; "
                f"got {self.file_mode!r}"
            )

    @property
    def modes(self) -> FileModes:
        return FILE_MODES[self.file_mode]
