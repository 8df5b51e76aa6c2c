"""L2: the index from page hash to host page (the pages are host_pool.py's), evicting
pages no copy is reading: copies of pages L1 also holds first (when their owner marks
them), then by retention hint (retention.py), then least recently used, a chain from its
tail."""

from __future__ import annotations

import heapq
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from kvstrata.kvcache.pages import PageAllocator
from kvstrata.kvcache.retention import NO_RETENTION, HeldHint, Retention


@dataclass
class _Entry:
    page_id: int
    num_readers: int = 0  # copies or L3 writes reading this page: never evict meanwhile
    from_l3: bool = False  # arrived by L3 prefetch (for the per-tier hit breakdown)
    retention: Retention = NO_RETENTION
    last_access_s: float = 0.0  # the cache's clock: the retention decays by it


class HostCache:
    """Which page hash sits in which L2 page. Only the engine thread calls it.

    Every host page is free (in the allocator), reserved by an in-flight L3 prefetch
    (allocated, not yet indexed), or indexed here. Indexed pages are evicted lowest
    effective retention priority first, then least recently used first, skipping pages
    with readers (without hints: exactly LRU).

    Recency is the page's last hit in any tier: a page demoted from L1 keeps the time it
    was last hit there (it is not new to the cache, only to L2). Pages a chain indexes or
    hits together are ordered tail first, so eviction shortens a chain from its end
    instead of stranding its tail behind an evicted head."""

    def __init__(
        self, allocator: PageAllocator, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.allocator = allocator
        self._clock_s = clock
        # Every indexed page; those not in `_aged` are in ascending `last_access_s`.
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        # Pages indexed with a last hit older than the newest entry's (demoted from L1),
        # in indexing order; `_aged_sorted` their eviction order (a superset: rebuilt
        # when a page is aged, read through `_aged` when one leaves).
        self._aged: dict[bytes, None] = {}
        self._aged_sorted: list[bytes] | None = []
        self._num_read_pages = 0  # indexed pages with at least one reader
        self._num_hinted_pages = 0  # indexed pages whose retention is not NO_RETENTION
        self._evict_first: dict[bytes, None] = {}  # of which evict-first (priority < 0)
        # Copies of pages L1 also holds, as their owner marks them (a non-inclusive L2):
        # displaced before any page only L2 holds, the newest copy first (L1 keeps the
        # pages it got last the longest).
        self._shadows: dict[bytes, None] = {}
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
        """Host pages of the leading `page_hashes` present in L2 (touches them, the
        chain's head last: it is the most recently used)."""
        hit: list[tuple[bytes, _Entry]] = []
        for page_hash in page_hashes:
            entry = self._entries.get(page_hash)
            if entry is None:
                break
            hit.append((page_hash, entry))
        now_s = self._clock_s()
        for page_hash, entry in reversed(hit):
            self._entries.move_to_end(page_hash)
            self._unage(page_hash)
            entry.last_access_s = now_s  # a hit renews the retention window
        return [entry.page_id for _, entry in hit]

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

    def add_chain(
        self,
        page_hashes: Sequence[bytes],
        page_ids: Sequence[int],
        from_l3: bool = False,
        hint: HeldHint | None = None,
    ) -> int:
        """Index allocated pages, consecutive pages of one chain (head first), with the
        hint they held in L1 when demoted from there. A hash already indexed keeps the
        copy already there (just as good; it takes the stronger hint) and the new page
        is freed. Returns how many pages were indexed."""
        if len(page_hashes) != len(page_ids):
            raise ValueError(f"{len(page_hashes)} hashes for {len(page_ids)} pages")
        now_s = self._clock_s()
        num_added = 0
        for page_hash, page_id in zip(reversed(page_hashes), reversed(page_ids)):
            if page_hash in self._entries:
                self.allocator.free([page_id])
                if hint is not None:
                    self.retain([page_hash], hint.retention)
                continue
            entry = _Entry(page_id, from_l3=from_l3, last_access_s=now_s)
            self._entries[page_hash] = entry
            num_added += 1
            if hint is None:
                continue
            self._set_retention(page_hash, entry, hint.retention)
            if hint.last_access_s < now_s:
                entry.last_access_s = hint.last_access_s
                self._aged[page_hash] = None
                self._aged_sorted = None
        return num_added

    def shadow(self, page_hashes: Iterable[bytes]) -> None:
        """The indexed pages among `page_hashes` copy pages L1 holds: L2 gives up their
        room before any other page's (their owner writes them again if L1 evicts them)."""
        for page_hash in page_hashes:
            if page_hash in self._entries:
                self._shadows.pop(page_hash, None)
                self._shadows[page_hash] = None

    def unshadow(self, page_hashes: Iterable[bytes]) -> None:
        """L1 no longer holds these pages: their copies here are ordinary L2 pages."""
        for page_hash in page_hashes:
            self._shadows.pop(page_hash, None)

    @property
    def num_shadow_pages(self) -> int:
        return len(self._shadows)

    def _unage(self, page_hash: bytes) -> None:
        self._aged.pop(page_hash, None)  # `_aged_sorted` skips it from now on

    def retain(self, page_hashes: Sequence[bytes], retention: Retention) -> None:
        """The indexed pages among `page_hashes` keep the stronger of their hint and
        `retention` (as `RadixCache.retain`)."""
        for page_hash in page_hashes:
            entry = self._entries.get(page_hash)
            if entry is not None:
                self._set_retention(page_hash, entry, entry.retention.stronger(retention))

    def reset_retention(self, page_hashes: Sequence[bytes], retention: Retention) -> None:
        """The indexed pages among `page_hashes` take `retention` in place of theirs."""
        for page_hash in page_hashes:
            entry = self._entries.get(page_hash)
            if entry is not None:
                self._set_retention(page_hash, entry, retention)

    def _set_retention(self, page_hash: bytes, entry: _Entry, retention: Retention) -> None:
        self._num_hinted_pages += (retention != NO_RETENTION) - (entry.retention != NO_RETENTION)
        if retention.priority < 0:
            self._evict_first[page_hash] = None
        else:
            self._evict_first.pop(page_hash, None)
        entry.retention = retention

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

    def alloc_displacing(self, num_pages: int, hint: HeldHint) -> list[int]:
        """Up to `num_pages` host pages for pages L1 evicts holding `hint`: free pages,
        then pages worth less than theirs (lower effective priority; at equal priority,
        hit less recently) or copies of pages L1 still holds, never one worth more. Fewer
        (maybe none) when L2 holds nothing worth less: the evicted pages are the least
        valuable of both tiers."""
        shortfall = num_pages - self.allocator.num_free_pages
        if shortfall > 0:
            now_s = self._clock_s()
            incoming = (hint.effective_priority(now_s), hint.last_access_s)
            victims = [
                page_hash
                for page_hash in self._victims(shortfall)
                if page_hash in self._shadows
                or self._value(self._entries[page_hash], now_s) < incoming
            ]
            self._drop(victims)
        return self.allocator.alloc(min(num_pages, self.allocator.num_free_pages))

    @staticmethod
    def _value(entry: _Entry, now_s: float) -> tuple[int, float]:
        priority = entry.retention.effective_priority(now_s - entry.last_access_s)
        return priority, entry.last_access_s

    def evict(self, num_pages: int) -> int:
        victims = self._victims(num_pages)
        self._drop(victims)
        return len(victims)

    def _victims(self, num_pages: int) -> list[bytes]:
        """Up to `num_pages` unread pages in eviction order: evict-first pages, then
        copies of pages L1 holds, then by retention and recency."""
        victims = [h for h in self._evict_first if not self._entries[h].num_readers]
        for page_hash in reversed(self._shadows):
            if len(victims) >= num_pages:
                break
            if not self._entries[page_hash].num_readers and page_hash not in self._evict_first:
                victims.append(page_hash)
        if len(victims) >= num_pages:
            return victims[:num_pages]
        if self._num_hinted_pages:
            return victims + self._victims_by_retention(num_pages - len(victims))
        for page_hash, entry in self._by_last_access():  # LRU first; stops when enough
            if len(victims) == num_pages:
                break
            if not entry.num_readers and page_hash not in self._shadows:
                victims.append(page_hash)
        return victims

    def _drop(self, victims: list[bytes]) -> None:
        for page_hash in victims:
            entry = self._entries.pop(page_hash)
            self._set_retention(page_hash, entry, NO_RETENTION)
            self._unage(page_hash)
            self._shadows.pop(page_hash, None)
            self.allocator.free([entry.page_id])
        self.num_evicted_pages += len(victims)
        if victims and self.evict_listener is not None:
            self.evict_listener(victims)

    def _victims_by_retention(self, num_pages: int) -> list[bytes]:
        """Up to `num_pages` unread pages that are neither evict-first nor copies of L1
        pages (`_victims` takes those first), lowest effective priority first and in LRU
        order within one priority: one pass in LRU order that stops once it has enough
        pages of priority 0."""
        victims: list[bytes] = []
        now_s = self._clock_s()
        by_priority: dict[int, list[bytes]] = {0: []}
        plain = by_priority[0]
        for page_hash, entry in self._by_last_access():
            if entry.num_readers or page_hash in self._evict_first or page_hash in self._shadows:
                continue
            priority = entry.retention.effective_priority(now_s - entry.last_access_s)
            by_priority.setdefault(priority, []).append(page_hash)
            if len(victims) + len(plain) == num_pages:
                break
        for priority in sorted(by_priority):
            victims += by_priority[priority][: num_pages - len(victims)]
            if len(victims) == num_pages:
                break
        return victims

    def _by_last_access(self) -> Iterator[tuple[bytes, _Entry]]:
        """Indexed pages, least recently hit first (aged pages merged in by their time;
        at equal times, in the order they were indexed)."""
        if not self._aged:
            return iter(self._entries.items())
        if self._aged_sorted is None:  # stable: a chain indexed tail first stays so
            self._aged_sorted = sorted(self._aged, key=lambda h: self._entries[h].last_access_s)
        aged = ((h, self._entries[h]) for h in self._aged_sorted if h in self._aged)
        in_order = ((h, e) for h, e in self._entries.items() if h not in self._aged)
        return heapq.merge(aged, in_order, key=lambda item: item[1].last_access_s)

    @property
    def num_read_pages(self) -> int:
        return self._num_read_pages

    @property
    def num_hinted_pages(self) -> int:
        """Indexed pages holding a retention hint (demoted or retained sessions' pages)."""
        return self._num_hinted_pages

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
        if not self._aged.keys() <= self._entries.keys():
            violations.append("L2: aged pages that are not indexed")
        if not self._shadows.keys() <= self._entries.keys():
            violations.append("L2: copies of L1 pages that are not indexed")
        num_hinted = sum(e.retention != NO_RETENTION for e in self._entries.values())
        first = {h for h, e in self._entries.items() if e.retention.priority < 0}
        if num_hinted != self._num_hinted_pages or first != self._evict_first.keys():
            violations.append(
                f"L2: {num_hinted} pages hold a hint ({len(first)} evict-first), the index "
                f"says {self._num_hinted_pages} ({len(self._evict_first)})"
            )
        return violations

    def reset(self) -> None:
        if self.num_read_pages:
            raise RuntimeError(f"reset of L2 with {self.num_read_pages} page(s) being read")
        self.allocator.free(e.page_id for e in self._entries.values())
        self._entries.clear()
        self._aged.clear()
        self._aged_sorted = []
        self._evict_first.clear()
        self._shadows.clear()
        self._num_hinted_pages = 0
