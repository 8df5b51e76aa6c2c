"""`make_storage_backend`: builds the L3 backend named by `--hicache-storage-backend` from
its options (`--hicache-storage-dir` and `--hicache-storage-backend-extra-config` JSON)."""

from __future__ import annotations

from collections.abc import Mapping

from kvstrata.kvcache.storage.base import StorageBackend
from kvstrata.kvcache.storage.trust import L3Trust

STORAGE_BACKENDS = ("file", "mooncake")
_FILE_OPTIONS = ("directory", "fsync", "threads")


def make_storage_backend(
    name: str,
    page_bytes: int,
    namespace: bytes,
    options: Mapping[str, object],
    trust: L3Trust | None = None,
) -> StorageBackend:
    """`file` options: directory (required), fsync (bool, default false), threads (pages
    of a batch read and written at once; default min(4, CPUs); 1: one after the other).
    `mooncake` options: the fields of `MooncakeConfig` (master_server_address required).
    `trust`: the page MAC key and file modes (default: the backend's own key, private).
    Unknown names and options raise ValueError: a typo must not fall back to a default;
    so does a `file` directory another user owns or may write (ConfigError)."""
    if name == "file":
        from kvstrata.kvcache.storage.file import DEFAULT_THREADS, FileStorage

        unknown = sorted(set(options) - set(_FILE_OPTIONS))
        if unknown:
            raise ValueError(
                f"unknown file storage option(s) {unknown}; known: {list(_FILE_OPTIONS)}"
            )
        directory = options.get("directory")
        if not directory:
            raise ValueError("--hicache-storage-backend file needs --hicache-storage-dir")
        threads = options.get("threads", DEFAULT_THREADS)
        if isinstance(threads, bool) or not isinstance(threads, int):
            raise ValueError(f"file storage option threads is a count, got {threads!r}")
        return FileStorage(
            str(directory),
            page_bytes,
            namespace,
            fsync=bool(options.get("fsync")),
            trust=trust,
            threads=threads,
        )
    if name == "mooncake":
        from kvstrata.kvcache.storage.mooncake import MooncakeStorage
        from kvstrata.kvcache.storage.mooncake_config import MooncakeConfig

        return MooncakeStorage(MooncakeConfig.from_options(options), page_bytes, namespace, trust)
    raise ValueError(
        f"--hicache-storage-backend {name!r} is not a storage backend; "
        f"choose one of {', '.join(STORAGE_BACKENDS)}"
    )
