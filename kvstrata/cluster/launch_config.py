"""`LaunchConfig`: the shape of a local cluster (`kvstrata launch` flags), validated once;
and the router fields and rank flags the launcher sets itself, which are no launch flags."""

from __future__ import annotations

from dataclasses import dataclass

from kvstrata.config import ConfigError, check_device, opt

# Router fields the launcher fills in itself; the others are `kvstrata launch` flags.
LAUNCHER_ROUTER_FIELDS = (
    "prefill",
    "decode",
    "host",
    "port",
    "model",
    "rank_api_key",
    "rank_api_key_file",
    "cluster_key",
    "cluster_key_file",
    "wait_for_registrations",
    "launch_proof_key_file",
)
# Rank flags the launcher sets itself.
LAUNCHER_RANK_FLAGS = ("register_with", "advertise_url")


@dataclass(frozen=True)
class LaunchConfig:
    """The shape of a local cluster (`kvstrata launch`); the ranks' own options are passed
    as rank flags and the router's as `RouterConfig` fields."""

    model: str = opt("", "Model directory, served by every rank.")
    num_prefill: int = opt(1, "Prefill ranks. 0: the decode ranks are unified ranks (no PD).")
    num_decode: int = opt(1, "Decode ranks (data-parallel behind the router).")
    num_routers: int = opt(
        1,
        "Routers, each subscribed to every rank on its own (the first on --port, the "
        "others on free ports); clients may use any of them.",
    )
    host: str = opt("127.0.0.1", "Address the routers listen on (ranks use 127.0.0.1).")
    port: int = opt(30000, "The first router's port (0: a free port).")
    log_dir: str = opt("", "Directory of the children's log files; default: a new temp dir.")
    rank_devices: tuple[str, ...] = opt(
        (),
        "Device of each rank in start order, prefill ranks first (e.g. cuda:0 cuda:1): "
        "one per rank (--tp-size N: N consecutive ones per rank), in place of the rank flag "
        "--device. Default: every rank gets --device.",
    )
    startup_timeout_s: float = opt(300.0, "Longest wait for every child to become healthy.")
    stop_grace_s: float = opt(40.0, "After SIGTERM, seconds a child may take before SIGKILL.")
    restart: bool = opt(
        True,
        "Restart a child (rank or router) that exits, on its own port, while the rest "
        "keep serving. --no-restart: any child exiting stops the whole cluster.",
    )
    restart_backoff_s: float = opt(
        1.0, "Delay before a restart; doubling with each restart in the window, up to 30 s."
    )
    max_restarts: int = opt(5, "Restarts of one child per --restart-window-s before giving up.")
    restart_window_s: float = opt(300.0, "The window --max-restarts counts restarts in.")

    def __post_init__(self) -> None:
        if not self.model:
            raise ConfigError("--model is required")
        if self.num_prefill < 0:
            raise ConfigError(f"--num-prefill must be >= 0, got {self.num_prefill}")
        if self.num_decode < 1:
            raise ConfigError(f"--num-decode must be >= 1, got {self.num_decode}")
        if self.num_routers < 1:
            raise ConfigError(f"--num-routers must be >= 1, got {self.num_routers}")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"--port must be in [0, 65535], got {self.port}")
        if self.startup_timeout_s <= 0 or self.stop_grace_s < 0:
            raise ConfigError("--startup-timeout-s must be > 0 and --stop-grace-s >= 0")
        if self.restart_backoff_s < 0 or self.max_restarts < 0 or self.restart_window_s <= 0:
            raise ConfigError(
                "--restart-backoff-s and --max-restarts must be >= 0, --restart-window-s > 0"
            )
        num_ranks = self.num_prefill + self.num_decode
        if self.rank_devices and len(self.rank_devices) % num_ranks:
            raise ConfigError(
                f"--rank-devices needs one device per rank ({num_ranks}: prefill ranks "
                f"first; --tp-size N: N per rank), got {len(self.rank_devices)}"
            )
        for device in self.rank_devices:
            check_device(device, "--rank-devices")
