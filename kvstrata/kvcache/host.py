"""L2: the host-memory page pool (page-first layout, pinned when CUDA is present) and its
index from page hash to host page, with LRU eviction of pages no copy is reading."""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvstrata.kvcache.pages import PageAllocator, give_back, zeroed_mapping

if TYPE_CHECKING:
    import mmap


class HostPool:
    """Page-first KV in host memory: `data[page]` is one page of every layer's K and V,
    shape `[num_layers, 2, page_size, num_kv_heads, head_dim]`, contiguous, so a page is
    one blob for L3 I/O (`page_bytes_view`)."""

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        pin_memory: bool,
    ) -> None:
        self.num_pages = num_pages
        shape = (num_pages, num_layers, 2, page_size, num_kv_heads, head_dim)
        self._mapping: mmap.mmap | None = None  # under unpinned storage
        if pin_memory:  # pinned memory is allocated, and resident, whole
            self.data = torch.zeros(shape, dtype=dtype, pin_memory=True)
        else:  # pages become resident as they are written
            self.data, self._mapping = zeroed_mapping(shape, dtype, "cpu")
        self.page_bytes = self.data[0].numel() * self.data.element_size()
        self._bytes = self.data.view(num_pages, -1).view(torch.uint8)

    def release(self) -> None:
        """Give the pool's memory back (as `KVPool.release`); idempotent, and the pool
        holds no pages afterwards."""
        give_back(self._mapping)
        self._mapping = None
        self.data = self.data.new_empty(0)
        self._bytes = self._bytes.new_empty((0, 0))

    def page_bytes_view(self, page_id: int) -> torch.Tensor:
        """Page `page_id` as a 1-D uint8 view (what the L3 backends read into / write from)."""
        return self._bytes[page_id]


@dataclass
class _Entry:
    page_id: int
    num_readers: int = 0  # copies or L3 writes reading this page: never evict meanwhile
    from_l3: bool = False  # arrived by L3 prefetch (for the per-tier hit breakdown)


class HostCache:
    """Which page hash sits in which L2 page. Only the engine thread calls it.

    Every host page is free (in the allocator), reserved by an in-flight L3 prefetch
    (allocated, not yet indexed), or indexed here. Indexed pages are evicted least
    recently used first, skipping pages with readers."""

    def __init__(self, allocator: PageAllocator) -> None:
        self.allocator = allocator
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # LRU first
        self._num_read_pages = 0  # indexed pages with at least one reader
        self.num_evicted_pages = 0
        # Called with the hashes `evict` dropped from the index (the cache digest).
        self.evict_listener: Callable[[list[bytes]], None] | None = None

    def __contains__(self, page_hash: bytes) -> bool:
        return page_hash in self._entries

    @property
    def num_cached_pages(self) -> int:
        return len(self._entries)

    @property
    def num_available_pages(self) -> int:
        """Free pages plus indexed pages nobody is reading."""
        return self.allocator.num_free_pages + len(self._entries) - self._num_read_pages

    def match(self, page_hashes: Sequence[bytes]) -> list[int]:
        """Host pages of the leading `page_hashes` present in L2 (touches them)."""
        page_ids = []
        for page_hash in page_hashes:
            entry = self._entries.get(page_hash)
            if entry is None:
                break
            self._entries.move_to_end(page_hash)
            page_ids.append(entry.page_id)
        return page_ids

    def from_l3(self, page_hash: bytes) -> bool:
        entry = self._entries.get(page_hash)
        return entry is not None and entry.from_l3

    def clear_from_l3(self, page_hash: bytes) -> None:
        entry = self._entries.get(page_hash)
        if entry is not None:
            entry.from_l3 = False

    def alloc(self, num_pages: int) -> list[int]:
        """Host pages for new data, evicting LRU pages if needed. Raises OutOfPages
        (from the allocator) when not enough pages can be freed."""
        shortfall = num_pages - self.allocator.num_free_pages
        if shortfall > 0:
            self.evict(shortfall)
        return self.allocator.alloc(num_pages)

    def add(self, page_hash: bytes, page_id: int, from_l3: bool = False) -> bool:
        """Index an allocated page. Returns False (and frees the page) if the hash is
        already indexed: the copy already there is just as good."""
        if page_hash in self._entries:
            self.allocator.free([page_id])
            return False
        self._entries[page_hash] = _Entry(page_id, from_l3=from_l3)
        return True

    def add_reader(self, page_hashes: Sequence[bytes]) -> None:
        for page_hash in page_hashes:
            entry = self._entries[page_hash]
            self._num_read_pages += entry.num_readers == 0
            entry.num_readers += 1

    def remove_reader(self, page_hashes: Sequence[bytes]) -> None:
        for page_hash in page_hashes:
            entry = self._entries[page_hash]
            if entry.num_readers < 1:
                raise RuntimeError(f"host page {entry.page_id} has no reader to remove")
            entry.num_readers -= 1
            self._num_read_pages -= entry.num_readers == 0

    def evict(self, num_pages: int) -> int:
        victims: list[bytes] = []
        for page_hash, entry in self._entries.items():  # LRU first; stops when enough
            if len(victims) == num_pages:
                break
            if not entry.num_readers:
                victims.append(page_hash)
        for page_hash in victims:
            self.allocator.free([self._entries.pop(page_hash).page_id])
        self.num_evicted_pages += len(victims)
        if victims and self.evict_listener is not None:
            self.evict_listener(victims)
        return len(victims)

    @property
    def num_read_pages(self) -> int:
        return self._num_read_pages

    # -- read-only views for the invariants' counts (HiRadixCache.invariant_counts) --

    @property
    def num_reader_pins(self) -> int:
        """Reader pins over all indexed pages (one per copy or L3 write in progress)."""
        return sum(entry.num_readers for entry in self._entries.values())

    def indexed_page_ids(self) -> list[int]:
        return [entry.page_id for entry in self._entries.values()]

    def check_integrity(self) -> list[str]:
        """The allocator's own invariants; each indexed page allocated and indexed once;
        reader counts >= 0 and the read-page counter equal to the entries'. (Free +
        indexed + reserved = total needs the prefetch reservations: HiRadixCache's.)"""
        violations = [f"L2 {v}" for v in self.allocator.check_integrity()]
        page_ids = self.indexed_page_ids()
        if len(set(page_ids)) != len(page_ids):
            twice = sorted(p for p, n in Counter(page_ids).items() if n > 1)
            violations.append(f"L2: pages indexed under two hashes: {twice[:10]}")
        num_total = self.allocator.num_total_pages
        outside = sorted(p for p in page_ids if not 0 <= p < num_total)
        if outside:
            violations.append(f"L2: indexed pages outside the pool: {outside[:10]}")
        free = self.allocator.free_among(p for p in page_ids if 0 <= p < num_total)
        if free:
            violations.append(f"L2: indexed pages that are free in the allocator: {free[:10]}")
        readers = [entry.num_readers for entry in self._entries.values()]
        if min(readers, default=0) < 0:
            violations.append("L2: a page with a negative reader count")
        num_read = len(readers) - readers.count(0)
        if num_read != self._num_read_pages:
            violations.append(
                f"L2: {num_read} pages have readers, counter says {self.num_read_pages}"
            )
        return violations

    def reset(self) -> None:
        if self.num_read_pages:
            raise RuntimeError(f"reset of L2 with {self.num_read_pages} page(s) being read")
        self.allocator.free(e.page_id for e in self._entries.values())
        self._entries.clear()
