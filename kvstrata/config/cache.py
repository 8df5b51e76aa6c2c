"""The cache sections every role reads: L1 (`L1Options`: the radix cache), L2
(`L2Options`: host memory) and L3 (`L3Options`: storage), each refusing its own bad values.
What needs two sections (L3 needs L2, L2 needs the radix cache) is `EngineConfig`'s."""

from __future__ import annotations

import json
from dataclasses import dataclass

from kvstrata.config.options import ConfigError, check_choices, opt
from kvstrata.config.secret import Secret

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")


@dataclass(frozen=True)
class L1Options:
    """The L1 prefix (radix) cache over the pool's pages."""

    disable_radix_cache: bool = opt(
        False,
        "Turn the L1 prefix (radix) cache off. Default: on, but off on decode ranks "
        "(SGLang's default).",
    )
    eviction_policy: str = opt(
        "priority",
        "Eviction order of cached L1 pages: lru, lfu, or priority (a request's retention "
        "hint and its session's state first: the priority, which falls to 0 once the "
        "pages went their retention time without a hit; then recency; without hints "
        "exactly lru).",
        ("lru", "lfu", "priority"),
        flag_name="radix_eviction_policy",
    )

    def __post_init__(self) -> None:
        check_choices(self)


@dataclass(frozen=True)
class L2Options:
    """The L2 host-memory pool behind L1, and how pages move between them."""

    enabled: bool = opt(
        False,
        "Back L1 with an L2 host-memory pool (and optionally L3 storage).",
        flag_name="enable_hierarchical_cache",
    )
    ratio: float = opt(2.0, "L2 pages as a multiple of L1 pages.", flag_name="hicache_ratio")
    size_gb: float = opt(
        0.0, "L2 size in GiB; overrides --hicache-ratio when > 0.", flag_name="hicache_size"
    )
    write_policy: str = opt(
        "write_through",
        "When L1 pages are copied to L2.",
        WRITE_POLICIES,
        flag_name="hicache_write_policy",
    )
    inclusion: str = opt(
        "non_inclusive",
        "What L2 does with its copies of pages L1 also holds. non_inclusive: they give way "
        "before any page only L2 holds, and L1 writes such a page to L2 again when it "
        "evicts it (displacing only pages worth less), so under pressure L1 and L2 hold up "
        "to L1 + L2 distinct pages, at the price of copies at eviction. inclusive: a copy "
        "is an ordinary L2 page (L2 holds what L1 holds; at most L2 distinct pages).",
        ("non_inclusive", "inclusive"),
        flag_name="hicache_inclusion",
    )
    io_backend: str = opt(
        "auto",
        "L1<->L2 copies: kernel (one Triton launch, zero-copy, CUDA only), direct (torch "
        "indexing), auto (kernel on CUDA).",
        ("auto", "kernel", "direct"),
        flag_name="hicache_io_backend",
    )

    def __post_init__(self) -> None:
        check_choices(self)


@dataclass(frozen=True)
class L3Options:
    """The L3 storage behind L2 (a directory or Mooncake Store), who may read its pages,
    and how admission waits for a prefetch from it."""

    backend: str = opt(
        "none",
        "L3 storage behind L2.",
        ("none", "file", "mooncake"),
        flag_name="hicache_storage_backend",
    )
    dir: str = opt(
        "",
        "Directory of the `file` L3 backend (shared safely by several processes).",
        flag_name="hicache_storage_dir",
    )
    extra_config: str = opt(
        "{}",
        "JSON options of the L3 backend (mooncake: master address, protocol, ...).",
        flag_name="hicache_storage_backend_extra_config",
    )
    # A `Secret` once resolved (never shown, /server_info included); its flag takes a str.
    key: Secret | None = opt(  # noqa: RUF009 (opt makes a dataclasses.field)
        None,
        "Secret that signs and checks every L3 page (HMAC-SHA256 under a key derived from "
        "it): ranks with the same secret read each other's pages; a page anyone else wrote "
        "or changed is refused and recomputed. Default: a served rank's cluster key; "
        "without one, for `file`, a key file the directory keeps (kvstrata-l3.key, made on "
        "first use), for `mooncake`, a key of the process's own (its pages serve it alone).",
        secret=True,
        flag_name="hicache_storage_key",
    )
    file_mode: str = opt(
        "private",
        "Who may use the `file` L3 directory: private (0600 page and key files in 0700 "
        "directories: this user's processes) or group (0640 files in 2770 directories: "
        "the directory's group, for ranks run by several users of it).",
        ("private", "group"),
        flag_name="hicache_storage_file_mode",
    )
    allow_shared_dir: bool = opt(
        False,
        "Use a `file` L3 directory that another user owns or other users may write, "
        "refused by default (they could delete or replace pages and plant a key file). "
        "Pages are still used only when their MAC verifies.",
        flag_name="hicache_storage_allow_shared_dir",
    )
    prefetch_policy: str = opt(
        "timeout",
        "How long admission waits for an L3 prefetch: not at all (best_effort: only what "
        "already arrived is used), until it completes, or a bounded time (timeout).",
        ("best_effort", "wait_complete", "timeout"),
        flag_name="hicache_storage_prefetch_policy",
    )
    prefetch_threshold: int = opt(
        256,
        "Prefetch from L3 only when at least this many tokens could come from it.",
        flag_name="hicache_prefetch_threshold",
    )
    prefetch_timeout_base_s: float = opt(
        0.5,
        "`timeout` prefetch policy: base wait in seconds.",
        flag_name="hicache_prefetch_timeout_base_s",
    )
    prefetch_timeout_per_1k_tokens_s: float = opt(
        0.25,
        "`timeout` prefetch policy: extra wait per 1,000 prefetched tokens.",
        flag_name="hicache_prefetch_timeout_per_1k_tokens_s",
    )
    io_threads: int = opt(
        4, "Worker threads for L3 reads and writes.", flag_name="hicache_io_threads"
    )

    def __post_init__(self) -> None:
        if self.io_threads < 1:
            raise ConfigError(f"--hicache-io-threads must be >= 1, got {self.io_threads}")
        if self.backend == "file" and not self.dir:
            raise ConfigError("--hicache-storage-backend file needs --hicache-storage-dir")
        try:
            extra = json.loads(self.extra_config)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--hicache-storage-backend-extra-config is not JSON: {e}") from e
        if not isinstance(extra, dict):
            raise ConfigError("--hicache-storage-backend-extra-config must be a JSON object")
        if self.key is not None and not isinstance(self.key, Secret):
            raise ConfigError("--hicache-storage-key must be a string")
        if self.key is not None and self.backend == "none":
            raise ConfigError(
                "--hicache-storage-key-file (--hicache-storage-key) needs --hicache-storage-backend"
            )
        if (self.file_mode, self.allow_shared_dir) != ("private", False) and self.backend != "file":
            name = "file-mode" if self.file_mode != "private" else "allow-shared-dir"
            raise ConfigError(f"--hicache-storage-{name} needs --hicache-storage-backend file")
        check_choices(self)

    @property
    def key_secret(self) -> str | None:
        """The page secret (from --hicache-storage-key-file or the cluster key), or None."""
        return self.key.reveal() if self.key is not None else None
