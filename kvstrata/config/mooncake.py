"""`MooncakeTransportConfig`: the settings of the `mooncake` KV transport, parsed and checked
from the JSON of `--disaggregation-mooncake-config`."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

FLAG = "--disaggregation-mooncake-config"
P2P_HANDSHAKE = "P2PHANDSHAKE"


@dataclass(frozen=True)
class MooncakeTransportConfig:
    """What one Transfer Engine needs. Prefill and decode ranks of one deployment must use
    the same metadata_server and protocol."""

    # "P2PHANDSHAKE" (peers exchange metadata directly; no service needed), or a metadata
    # service: "http://host:port/metadata" (mooncake_master's HTTP server), etcd, redis.
    metadata_server: str = P2P_HANDSHAKE
    protocol: str = "tcp"  # "tcp" works anywhere; "rdma" needs RDMA NICs
    device_name: str = ""  # RDMA devices, e.g. "mlx5_0,mlx5_1"; empty: all (or tcp)
    # The address peers reach this rank at (host only: the engine picks its own port).
    # Set it to this host's LAN address when prefill and decode run on different hosts.
    local_hostname: str = "127.0.0.1"
    # A write fails once none of its transfers has finished for this long (a dead or
    # frozen decode rank); a first contact fails if the peer does not answer within it.
    timeout_s: float = 5.0
    # Coalesced writes (mooncake_staging.py): a write whose pages are scattered is gathered
    # into staging slots, sent as large transfers and scattered by the decode rank. Off:
    # every run of consecutive pages is its own transfer (32 KiB each for qwen3-8b pages).
    coalesce: bool = True
    # One staging slot; a slot's bytes travel as transfers of at most 4 MiB.
    staging_slot_bytes: int = 8 << 20
    # Decode side: slots in its staging region (a sender leases up to 4 while connected).
    staging_slots: int = 8
    # Host staging: every write comes through the staging slots (coalesced even when its
    # pages are consecutive), and with GPU pools the slots at both ends live in pinned
    # host memory: each end moves a slot to or from its pool with one copy on a stream of
    # its own. The Transfer Engine's tcp transport copies GPU memory with one synchronous
    # cudaMemcpy per 64 KiB slice on its single io thread, which crawls while the GPU
    # computes; between host buffers it copies nothing (docs/results.md, issue 17.2).
    # "auto": on for tcp with GPU pools (RDMA reads GPU memory itself); "on", "off"
    # (JSON true/false mean the same).
    host_staging: str = "auto"

    @classmethod
    def from_json(cls, text: str) -> MooncakeTransportConfig:
        """Refuses bad JSON, unknown keys (a typo must not fall back to a default) and bad
        values, naming the flag."""
        try:
            options = json.loads(text or "{}")
        except json.JSONDecodeError as e:
            raise ValueError(f"{FLAG} is not valid JSON ({e}): {text!r}") from None
        if not isinstance(options, dict):
            raise ValueError(f"{FLAG} must be a JSON object, got {text!r}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - set(fields))
        if unknown:
            raise ValueError(f"unknown key(s) {unknown} in {FLAG}; known: {sorted(fields)}")
        if isinstance(options.get("host_staging"), bool):
            options["host_staging"] = "on" if options["host_staging"] else "off"
        for name, value in options.items():
            expected = type(fields[name].default)  # str, float, bool or int
            ok = isinstance(value, expected) and (expected is bool or not isinstance(value, bool))
            ok = ok or (expected is float and type(value) is int)
            if not ok:
                raise ValueError(f"{FLAG}: {name} must be a {expected.__name__}, got {value!r}")
        config = cls(**options)
        config.validate()
        return config

    def validate(self) -> None:
        if self.protocol not in ("tcp", "rdma"):
            raise ValueError(f"{FLAG}: protocol must be tcp or rdma, got {self.protocol!r}")
        if not self.metadata_server:
            raise ValueError(f"{FLAG}: metadata_server must not be empty (or {P2P_HANDSHAKE!r})")
        host = self.local_hostname
        if not host or (host.count(":") == 1 and host.rsplit(":", 1)[1].isdigit()):
            raise ValueError(f"{FLAG}: local_hostname must be a host without a port, got {host!r}")
        if not float(self.timeout_s) > 0:
            raise ValueError(f"{FLAG}: timeout_s must be positive, got {self.timeout_s!r}")
        if self.staging_slot_bytes < 4096:
            raise ValueError(
                f"{FLAG}: staging_slot_bytes must be at least 4096, got {self.staging_slot_bytes}"
            )
        if self.host_staging not in ("auto", "on", "off"):
            raise ValueError(
                f"{FLAG}: host_staging must be auto, on or off, got {self.host_staging!r}"
            )
        if self.host_staging == "on" and not self.coalesce:
            raise ValueError(f"{FLAG}: host_staging needs coalesce")
        if self.staging_slots < 1:
            raise ValueError(f"{FLAG}: staging_slots must be at least 1, got {self.staging_slots}")

    def host_staging_for(self, pool_on_cuda: bool) -> bool:
        """Whether every write comes through staging (in pinned host slots when the pool
        is on a GPU): "auto" means tcp with a GPU pool."""
        if self.host_staging == "auto":
            return self.coalesce and self.protocol == "tcp" and pool_on_cuda
        return self.host_staging == "on"

    @property
    def uses_p2p_handshake(self) -> bool:
        return self.metadata_server == P2P_HANDSHAKE
