"""L3 storage of whole KV pages keyed by page hash: the contract, the page format, the
`file` and `mooncake` backends, and `make_storage_backend`, the one place choosing them."""

from kvstrata.kvcache.storage.base import StorageBackend, StorageStats
from kvstrata.kvcache.storage.factory import STORAGE_BACKENDS, make_storage_backend

__all__ = ["STORAGE_BACKENDS", "StorageBackend", "StorageStats", "make_storage_backend"]
