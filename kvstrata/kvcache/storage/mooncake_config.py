"""`MooncakeConfig`: the settings of the Mooncake Store backend, parsed and checked from the
options dict that `--hicache-storage-backend-extra-config` JSON carries."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNIT_BYTES = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE_FIELDS = ("global_segment_size", "local_buffer_size", "staging_bytes")


@dataclass(frozen=True)
class MooncakeConfig:
    """What the store client needs. Sizes are bytes (ints, or strings such as "4gb")."""

    master_server_address: str  # "host:port" of mooncake_master's RPC service
    # "P2PHANDSHAKE" (no metadata service), or the master's HTTP metadata server
    # ("http://host:port/metadata"), or an etcd address.
    metadata_server: str = "P2PHANDSHAKE"
    protocol: str = "tcp"  # "tcp" works anywhere; "rdma" needs device_name
    device_name: str = ""  # RDMA devices, e.g. "mlx5_0"; empty for tcp
    # The address other store clients reach this process at: set it to this host's LAN
    # address when the store spans hosts.
    local_hostname: str = "127.0.0.1"
    global_segment_size: int = 1 << 30  # memory this process lends to the store's pool
    local_buffer_size: int = 16 << 20  # the client's own transfer buffer
    staging_bytes: int = 64 << 20  # registered bounce buffer for this backend's I/O
    timeout_s: float = 5.0  # longest wait for one store call before it counts as a miss
    setup_timeout_s: float = 10.0  # longest wait for the first connection at start-up
    retry_interval_s: float = 5.0  # between connection attempts while the master is down
    io_threads: int = 4  # worker threads issuing store calls

    @classmethod
    def from_options(cls, options: Mapping[str, object]) -> MooncakeConfig:
        """Refuses unknown keys (a typo must not silently fall back to a default)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(
                f"unknown Mooncake storage option(s) {unknown} in "
                f"--hicache-storage-backend-extra-config; known: {sorted(known)}"
            )
        if not options.get("master_server_address"):
            raise ValueError(
                "--hicache-storage-backend mooncake needs master_server_address "
                '(e.g. {"master_server_address": "127.0.0.1:50051"}) in '
                "--hicache-storage-backend-extra-config"
            )
        values = dict(options)
        for name in _SIZE_FIELDS:
            if name in values:
                values[name] = parse_bytes(values[name], name)
        config = cls(**values)  # type: ignore[arg-type]
        config.validate()
        return config

    def validate(self) -> None:
        if self.protocol not in ("tcp", "rdma"):
            raise ValueError(f"Mooncake protocol must be tcp or rdma, got {self.protocol!r}")
        for name in ("timeout_s", "setup_timeout_s", "retry_interval_s"):
            if not float(getattr(self, name)) > 0:
                raise ValueError(f"Mooncake option {name} must be positive")
        if int(self.io_threads) < 1:
            raise ValueError("Mooncake option io_threads must be at least 1")
        for name in _SIZE_FIELDS:
            if int(getattr(self, name)) < 1:
                raise ValueError(f"Mooncake option {name} must be positive")


def parse_bytes(value: object, name: str) -> int:
    """1048576, "1048576", "1mb", "1MiB", "1.5gb" -> bytes."""
    if isinstance(value, bool):
        raise ValueError(f"Mooncake option {name} is a size, got {value!r}")
    if isinstance(value, int):
        return value
    match = _SIZE.match(str(value))
    if not match:
        raise ValueError(f"Mooncake option {name} is a size such as 4gb, got {value!r}")
    number, unit = match.groups()
    return int(float(number) * _UNIT_BYTES[(unit or "")[:1].lower()])
