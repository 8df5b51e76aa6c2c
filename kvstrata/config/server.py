"""`ServerConfig`: the options of one rank's HTTP server (address, limits, the API key and
the cluster key, which are read from files or the environment so they stay off the
command line)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvstrata.config.limits import check_size_limits
from kvstrata.config.options import (
    ConfigError,
    check_choices,
    flag,
    key_file_opt,
    opt,
    resolve_key_files,
)

# Per client address, on ranks and the router: generous enough for hundreds of clients
# behind one NAT (and for a router opening connections to a rank under a load spike).
NEW_CONNECTIONS_PER_S = 1000.0
# Where a hand-started rank or router finds the cluster key when no --cluster-key-file
# is given (the environment of a process is readable only by its own user).
CLUSTER_KEY_ENV = "KVSTRATA_CLUSTER_KEY"
CLUSTER_KEY_HELP = (
    "The key ranks and routers of one cluster share: rank-to-rank endpoints (/pd/*) and "
    "the X-Kvstrata-Prefill-Url header are refused (401) without it. Prefer "
    f"--cluster-key-file or ${CLUSTER_KEY_ENV}; kvstrata launch generates one."
)
NEW_CONNECTIONS_BURST = 2000


@dataclass(frozen=True)
class ServerConfig:
    """Options of one rank's HTTP front end (`kvstrata serve`)."""

    host: str = opt("127.0.0.1", "Address to listen on.")
    port: int = opt(30000, "TCP port to listen on.")
    api_key: str | None = opt(
        None,
        "If set, every endpoint but /health needs 'Authorization: Bearer KEY'. Prefer "
        "--api-key-file: a key on the command line is visible to every user of the host.",
        secret=True,
    )
    api_key_file: str | None = key_file_opt("api_key")
    cluster_key: str | None = opt(None, CLUSTER_KEY_HELP, secret=True, env=CLUSTER_KEY_ENV)
    cluster_key_file: str | None = key_file_opt("cluster_key")
    served_model_name: str | None = opt(
        None, "Model name clients send and responses report; default: the --model value."
    )
    rank: int = opt(0, "This rank's index, reported in usage.kvstrata.rank and /get_load.")
    max_prompt_tokens: int | None = opt(
        None, "Longest prompt accepted, in tokens (else 400), checked right after "
        "tokenization; text longer than 32 characters per such token is refused before "
        "it is tokenized. Default: the context length.",
    )  # fmt: skip
    max_body_bytes: int | None = opt(
        None, "Largest request body accepted (else 413). Default: what the longest allowed "
        "prompt needs (7 bytes per token id, 4 per character of text, plus 64 KiB).",
    )  # fmt: skip
    new_connections_per_s: float = opt(
        NEW_CONNECTIONS_PER_S, "New connections accepted per second from one client address "
        "(a token bucket's refill; 0: no limit). Beyond it: 429.",
    )  # fmt: skip
    new_connections_burst: int = opt(
        NEW_CONNECTIONS_BURST, "New connections one client address may open at once."
    )
    shutdown_grace_s: float = opt(
        30.0, "On SIGTERM: seconds in-flight requests may run before they are aborted."
    )
    log_level: str = opt(
        "info", "Server log level.", ("critical", "error", "warning", "info", "debug")
    )
    prefill_urls: str = opt(
        "",
        "Decode mode: comma-separated prefill rank URLs to use when a request does not "
        "name one (the router names one with the X-Kvstrata-Prefill-Url header).",
    )
    pd_transfer_timeout_s: float = opt(
        600.0, "Decode mode: longest wait for a prefill rank to compute and send a room."
    )
    disaggregation_kv_failure_policy: str = opt(
        "retry",
        "Decode mode: what a failed room (prefill rank dead, frozen or erroring, a failed "
        "or timed-out write, a result that does not match its room) leads to. retry: a new "
        "room on another prefill rank of --prefill-urls not tried yet, then recompute; "
        "recompute: this rank prefills the request itself; fail: the request fails.",
        ("retry", "recompute", "fail"),
    )

    def __post_init__(self) -> None:
        resolve_key_files(self)
        self.validate()

    @property
    def prefill_url_list(self) -> list[str]:
        return [u.strip().rstrip("/") for u in self.prefill_urls.split(",") if u.strip()]

    def validate(self) -> None:
        if not 0 < self.port < 65536:
            raise ConfigError(f"--port must be in [1, 65535], got {self.port}")
        for name in ("api_key", "cluster_key"):
            if getattr(self, name) is not None and not getattr(self, name):
                raise ConfigError(f"{flag(name)} must not be empty")
        if self.served_model_name is not None and not self.served_model_name:
            raise ConfigError("--served-model-name must not be empty")
        if self.rank < 0:
            raise ConfigError(f"--rank must be >= 0, got {self.rank}")
        check_size_limits(self)
        check_connection_limit(self)
        if self.shutdown_grace_s < 0:
            raise ConfigError(f"--shutdown-grace-s must be >= 0, got {self.shutdown_grace_s}")
        if self.pd_transfer_timeout_s <= 0:
            raise ConfigError(
                f"--pd-transfer-timeout-s must be > 0, got {self.pd_transfer_timeout_s}"
            )
        for url in self.prefill_url_list:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"--prefill-urls: {url!r} is not an http(s) URL")
        check_choices(self)


def check_connection_limit(config: Any) -> None:
    if config.new_connections_per_s < 0:
        raise ConfigError(
            f"--new-connections-per-s must be >= 0, got {config.new_connections_per_s}"
        )
    if config.new_connections_burst < 1:
        raise ConfigError(
            f"--new-connections-burst must be >= 1, got {config.new_connections_burst}"
        )
