"""`make_storage_backend`: builds the L3 backend named by `--hicache-storage-backend` from
its options (`--hicache-storage-dir` and `--hicache-storage-backend-extra-config` JSON)."""

from __future__ import annotations

from collections.abc import Mapping

from kvstrata.kvcache.storage.base import StorageBackend

STORAGE_BACKENDS = ("file", "mooncake")
_FILE_OPTIONS = ("directory", "fsync")


def make_storage_backend(
    name: str, page_bytes: int, namespace: bytes, options: Mapping[str, object]
) -> StorageBackend:
    """`file` options: directory (required), fsync (bool, default false).
    `mooncake` options: the fields of `MooncakeConfig` (master_server_address required).
    Unknown names and options raise ValueError: a typo must not fall back to a default."""
    if name == "file":
        from kvstrata.kvcache.storage.file import FileStorage

        unknown = sorted(set(options) - set(_FILE_OPTIONS))
        if unknown:
            raise ValueError(
                f"unknown file storage option(s) {unknown}; known: {list(_FILE_OPTIONS)}"
            )
        directory = options.get("directory")
        if not directory:
            raise ValueError("--hicache-storage-backend file needs --hicache-storage-dir")
        return FileStorage(str(directory), page_bytes, namespace, fsync=bool(options.get("fsync")))
    if name == "mooncake":
        from kvstrata.kvcache.storage.mooncake import MooncakeStorage
        from kvstrata.kvcache.storage.mooncake_config import MooncakeConfig

        return MooncakeStorage(MooncakeConfig.from_options(options), page_bytes, namespace)
    raise ValueError(
        f"--hicache-storage-backend {name!r} is not a storage backend; "
        f"choose one of {', '.join(STORAGE_BACKENDS)}"
    )
