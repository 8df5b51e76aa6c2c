"""One simulated rank's KV cache: the real RadixCache (and HiRadixCache over a metadata-only
HostCache when L2 is on) over a PageAllocator, with a no-op copier, plus the shared L3
set. Admitting a request matches, pins and allocates like the engine's KV manager."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstrata.core import CacheHandle
from kvstrata.kvcache.copier import CopyStats
from kvstrata.kvcache.digest import CacheDigest
from kvstrata.kvcache.hiradix import HiRadixCache, PrefetchPolicy, WritePolicy
from kvstrata.kvcache.host import HostCache
from kvstrata.kvcache.pages import PageAllocator
from kvstrata.kvcache.radix import RadixCache
from kvstrata.kvcache.tiers import HashSource, L1Tiers, TieredCache


def _nothing() -> None:
    pass


class NullCopier:
    """The Copier contract with no bytes behind it: the simulator charges copy time in
    its cost model instead."""

    def __init__(self) -> None:
        self.backup_stats = CopyStats()
        self.load_back_stats = CopyStats()

    def backup(self, l1_page_ids: list[int], host_page_ids: list[int]) -> None:
        self.backup_stats.num_pages += len(l1_page_ids)

    def load_back(self, host_page_ids: list[int], l1_page_ids: list[int]) -> None:
        self.load_back_stats.num_pages += len(l1_page_ids)

    def fence_loads(self) -> None:
        pass

    def fence_l1(self) -> None:
        pass

    def host_fence(self) -> Callable[[], None]:
        return _nothing


@dataclass(frozen=True)
class Admission:
    """A request holding its pages: the prompt split by where its KV came from.

    [0, l1_len) L1 hit | [l1_len, +l2_len) L2 load-back | [.., +l3_len) L3 read | rest new"""

    l1_len: int
    l2_len: int
    l3_len: int
    page_ids: list[int]
    handle: CacheHandle


class RankCache:
    def __init__(
        self, num_l1_pages: int, num_l2_pages: int, page_size: int, l3: set[bytes] | None
    ) -> None:
        """`l3`: the page hashes in the cluster's shared storage (None: no L3)."""
        self.page_size = page_size
        self.allocator = PageAllocator(num_l1_pages)
        self.radix = RadixCache(self.allocator, page_size)
        self.tiers: TieredCache
        if num_l2_pages:
            self.tiers = HiRadixCache(
                self.radix,
                HostCache(PageAllocator(num_l2_pages)),
                NullCopier(),
                WritePolicy.named("write_through"),
                None,
                PrefetchPolicy("best_effort", 0, 0, 0),
            )
        else:
            self.tiers = L1Tiers(self.radix)
        self.l3 = l3

    @property
    def digest(self) -> CacheDigest:
        assert self.tiers.digest is not None
        return self.tiers.digest

    def fits_ever(self, num_tokens: int) -> bool:
        return self._num_pages(num_tokens) <= self.allocator.num_total_pages

    def try_admit(
        self, token_ids: Sequence[int], hashes: HashSource, num_total_tokens: int
    ) -> Admission | None:
        """Match the prompt across tiers, pin it, restore its L2 part into L1 and allocate
        pages for the other `num_total_tokens` (prompt rest + output). None, changing
        nothing, when L1 cannot supply the pages even after evicting."""
        match = self.tiers.match(token_ids, hashes)
        num_l3_pages = 0
        if self.l3 is not None:
            chain = hashes(len(token_ids) // self.page_size)
            for page_hash in chain[match.prefix_len // self.page_size :]:
                if page_hash not in self.l3:
                    break
                num_l3_pages += 1
        self.tiers.lock(match)
        num_new_pages = self._num_pages(num_total_tokens) - match.l1.num_pages
        if num_new_pages > self.allocator.num_free_pages + self.radix.num_evictable_pages:
            self.tiers.unlock(match)
            return None
        shortfall = num_new_pages - self.allocator.num_free_pages
        if shortfall > 0:
            self.radix.evict(shortfall)
        l1 = self.tiers.restore(token_ids, match, hashes)
        page_ids = l1.page_ids + self.allocator.alloc(
            self._num_pages(num_total_tokens) - l1.num_pages
        )
        return Admission(
            match.l1_len,
            match.l2_len + match.l3_len,
            num_l3_pages * self.page_size,
            page_ids,
            l1.handle,
        )

    def release(self, admission: Admission, token_ids: Sequence[int], hashes: HashSource) -> None:
        """The request finished: its prompt's full pages go to the cache (and to L3), the
        rest are freed, the pin is dropped."""
        num_full_pages = len(token_ids) // self.page_size
        full_len = num_full_pages * self.page_size
        self.tiers.insert(token_ids[:full_len], admission.page_ids[:num_full_pages], hashes)
        self.allocator.free(admission.page_ids[num_full_pages:])
        self.radix.unlock(admission.handle)
        if self.l3 is not None:
            self.l3.update(hashes(num_full_pages))

    def _num_pages(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)
