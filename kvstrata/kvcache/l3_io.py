"""L3 I/O on worker threads: prefetch reads (storage -> reserved L2 pages) and background
writes (L2 pages -> storage). Workers touch only the page bytes they were handed; every
index update happens on the engine thread when it collects a finished job."""

from __future__ import annotations

import hashlib
import logging
import struct
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from kvstrata.kvcache.host_pool import HostPool

if TYPE_CHECKING:
    from kvstrata.kvcache.storage.base import StorageBackend

log = logging.getLogger(__name__)


@dataclass
class L3Job:
    """One batch of pages moving between L2 and L3. `future` yields, for a read, the
    number of leading pages that arrived intact; for a write, the number stored."""

    page_hashes: list[bytes]
    host_page_ids: list[int]
    future: Future[int]
    start_s: float = field(default_factory=time.monotonic)
    collected: bool = False  # the engine thread indexed what arrived (a read's pages are in L2)
    # A read: how many leading pages L3 holds, known before their bytes arrive.
    present: Future[int] = field(default_factory=Future)


class L3Port(Protocol):
    """What the cache asks of L3 (an `L3IO`, or a TP leader's, which its followers mirror)."""

    backend: StorageBackend

    def read(self, page_hashes: list[bytes], host_page_ids: list[int]) -> L3Job: ...

    def write(
        self,
        page_hashes: list[bytes],
        host_page_ids: list[int],
        ready: Callable[[], None] | None = None,
    ) -> L3Job: ...

    def clear(self) -> int: ...

    def shutdown(self) -> None: ...


def slice_salt(tp_size: int, tp_rank: int) -> bytes:
    """The storage-key salt of tensor-parallel worker `tp_rank` of `tp_size`: each worker
    stores its head slice of a page under its own key (none for a TP 1 rank)."""
    if tp_size == 1:
        return b""
    return b"kvstrata/tp-slice/" + struct.pack("<II", tp_size, tp_rank)


class L3IO:
    def __init__(
        self,
        backend: StorageBackend,
        host_pool: HostPool,
        num_threads: int,
        key_salt: bytes = b"",
    ) -> None:
        """`key_salt` (`slice_salt`): a page's storage key is sha256(salt + page hash)."""
        self.backend = backend
        self.host_pool = host_pool
        self.key_salt = key_salt
        self._pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="kv-l3")

    def _keys(self, page_hashes: list[bytes]) -> list[bytes]:
        if not self.key_salt:
            return page_hashes
        return [hashlib.sha256(self.key_salt + h).digest() for h in page_hashes]

    def read(self, page_hashes: list[bytes], host_page_ids: list[int]) -> L3Job:
        """Fetch the leading pages of `page_hashes` that L3 holds into `host_page_ids`."""
        present: Future[int] = Future()
        future = self._pool.submit(self._read, page_hashes, host_page_ids, present)
        return L3Job(page_hashes, host_page_ids, future, present=present)

    def write(
        self,
        page_hashes: list[bytes],
        host_page_ids: list[int],
        ready: Callable[[], None] | None = None,
    ) -> L3Job:
        """Write host pages to L3 on a worker thread, which first waits on `ready` (the
        pages' backup to the host is done)."""
        future = self._pool.submit(self._write, page_hashes, host_page_ids, ready)
        return L3Job(page_hashes, host_page_ids, future)

    def _read(
        self, page_hashes: list[bytes], host_page_ids: list[int], present: Future[int]
    ) -> int:
        try:
            keys = self._keys(page_hashes)
            num_present = self.backend.batch_exists(keys)
            present.set_result(num_present)
            views = [self.host_pool.page_bytes_view(p) for p in host_page_ids[:num_present]]
            ok = self.backend.batch_get(keys[:num_present], views)
        except Exception:  # a backend must not raise, but a miss is always safe
            log.exception("L3 read failed; treating it as a miss")
            return 0
        finally:
            if not present.done():
                present.set_result(0)
        num_ok = 0
        while num_ok < len(ok) and ok[num_ok]:
            num_ok += 1
        return num_ok

    def _write(
        self,
        page_hashes: list[bytes],
        host_page_ids: list[int],
        ready: Callable[[], None] | None = None,
    ) -> int:
        try:
            if ready is not None:
                ready()
            views = [self.host_pool.page_bytes_view(p) for p in host_page_ids]
            return sum(self.backend.batch_set(self._keys(page_hashes), views))
        except Exception:
            log.exception("L3 write failed; the pages stay in L2 only")
            return 0

    def clear(self) -> int:
        return self.backend.clear()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
