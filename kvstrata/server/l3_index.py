"""What a rank tells routers about its L3 store: which store it is (`store_id`: ranks
with the same id restore each other's pages) and, for `POST /hicache/storage/exists`,
how many leading pages of a request the store holds, read from the store's own index."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstrata.kvcache.hiradix import HiRadixCache

if TYPE_CHECKING:
    from kvstrata.engine.engine import Engine
    from kvstrata.kvcache.storage.base import StorageBackend


@dataclass(frozen=True)
class L3Index:
    """A rank's L3 store as routers see it. `backend` is thread-safe (its contract), so
    existence queries run on worker threads, never on the engine thread."""

    store_id: str
    backend: StorageBackend

    @classmethod
    def of(cls, engine: Engine) -> L3Index | None:
        """Before the engine thread starts (construction-time facts only); None without L3."""
        tiers = engine.tiers
        if not isinstance(tiers, HiRadixCache) or tiers.l3 is None:
            return None
        backend = tiers.l3.backend
        return cls(_store_id(backend), backend)

    def num_leading_pages(self, page_hashes: list[bytes]) -> int:
        """Blocking (storage I/O): how many leading pages of the chain the store holds."""
        return self.backend.batch_exists(page_hashes)


def _store_id(backend: StorageBackend) -> str:
    """The same for every rank reading the same pages: the backend, where it keeps them
    (a file store's resolved directory, a Mooncake store's master), the namespace and the
    key's fingerprint (ranks with other keys refuse each other's pages)."""
    directory = getattr(backend, "directory", None)
    config = getattr(backend, "config", None)
    if directory is not None:
        where = os.path.realpath(directory)
    elif config is not None and hasattr(config, "master_server_address"):
        where = config.master_server_address
    else:
        where = f"process-{os.getpid()}"  # an unknown backend: shared with no one
    return f"{backend.name}:{where}:{backend.namespace.hex()[:16]}:{backend.key_id}"
