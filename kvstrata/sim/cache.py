"""One simulated rank's KV cache: the real RadixCache (and HiRadixCache over a metadata-only
HostCache when L2 is on) over a PageAllocator, with a no-op copier, plus the shared L3
set, and the real SessionTable when sessions are on. Every cache object reads the
simulator's clock. Admitting a request matches, pins and allocates like the engine's KV
manager; releasing it inserts and ends its session's turn like the engine."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstrata.config.sessions import SessionOptions
from kvstrata.core import CacheHandle, SessionRef
from kvstrata.kvcache.copier import CopyStats
from kvstrata.kvcache.digest import CacheDigest
from kvstrata.kvcache.hiradix import HiRadixCache, PrefetchPolicy, WritePolicy
from kvstrata.kvcache.host import HostCache
from kvstrata.kvcache.pages import PageAllocator
from kvstrata.kvcache.radix import RadixCache
from kvstrata.kvcache.sessions import SessionTable
from kvstrata.kvcache.tiers import HashSource, L1Tiers, TieredCache


class SimClock:
    """The simulator's virtual time in seconds: what every cache's retention decays by.
    The event loop sets `now_s`; caches call the clock."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


@dataclass(frozen=True)
class CachePolicy:
    """How a simulated rank's cache keeps pages: the L1 eviction order, when L1 pages are
    copied to L2 (with L2), the session table's options (None: no sessions), and whether
    L2 includes L1 (the engine's --hicache-inclusion)."""

    eviction_policy: str = "lru"
    write_policy: str = "write_through"
    sessions: SessionOptions | None = None
    l2_inclusion: str = "non_inclusive"


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
        self,
        num_l1_pages: int,
        num_l2_pages: int,
        page_size: int,
        l3: set[bytes] | None,
        policy: CachePolicy = CachePolicy(),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`l3`: the page hashes in the cluster's shared storage (None: no L3); `clock`:
        the simulator's (retention windows are measured on it)."""
        self.page_size = page_size
        self.allocator = PageAllocator(num_l1_pages)
        self.radix = RadixCache(self.allocator, page_size, policy.eviction_policy, clock=clock)
        self.tiers: TieredCache
        if num_l2_pages:
            self.tiers = HiRadixCache(
                self.radix,
                HostCache(PageAllocator(num_l2_pages), clock=clock),
                NullCopier(),
                WritePolicy.named(policy.write_policy),
                None,
                PrefetchPolicy("best_effort", 0, 0, 0),
                inclusive=policy.l2_inclusion == "inclusive",
            )
        else:
            self.tiers = L1Tiers(self.radix)
        self.l3 = l3
        self.sessions: SessionTable | None = None
        if policy.sessions is not None:
            self.sessions = SessionTable(self.tiers, policy.sessions)

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

    def stranded_pages(self, page_hashes: Sequence[bytes], num_matched_pages: int) -> int:
        """Pages of a prompt past its match (`page_hashes[num_matched_pages:]`) that L1 or
        L2 still holds: unusable, since a page before them is gone (a diagnostic)."""
        tiers = self.tiers
        if not isinstance(tiers, HiRadixCache):
            return 0  # L1 alone is a tree: a page is cached only with its whole prefix
        return sum(
            h in tiers.l1_index or h in tiers.host for h in page_hashes[num_matched_pages + 1 :]
        )

    def turn_started(self, session: SessionRef) -> None:
        """A turn of `session` arrived (the engine tells its table on arrival)."""
        if self.sessions is not None:
            self.sessions.turn_started(session)

    def release(
        self,
        admission: Admission,
        token_ids: Sequence[int],
        hashes: HashSource,
        session: SessionRef | None = None,
    ) -> None:
        """The request finished: the full pages of `token_ids` (its prompt, and its answer
        when given) go to the cache (and to L3), the rest are freed, the pin is dropped;
        then its session's turn ends (paused, or closed by a final turn)."""
        num_full_pages = len(token_ids) // self.page_size
        full_len = num_full_pages * self.page_size
        self.tiers.insert(token_ids[:full_len], admission.page_ids[:num_full_pages], hashes)
        if session is not None and self.sessions is not None:
            self.sessions.pages_released(session, token_ids[:full_len], hashes)
        self.allocator.free(admission.page_ids[num_full_pages:])
        self.radix.unlock(admission.handle)
        if self.l3 is not None:
            self.l3.update(hashes(num_full_pages))
        if session is not None and self.sessions is not None:
            self.sessions.turn_ended(session)

    def _num_pages(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)
