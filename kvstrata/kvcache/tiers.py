"""The tiered-cache contract the engine's KV manager talks to, and `L1Tiers`, the
implementation when only the L1 prefix cache exists (HiRadixCache in hiradix.py adds
L2 and L3). Only the engine thread calls these. Both report page events to a digest."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol

from kvstrata.core import PrefixMatch, TierMatch
from kvstrata.kvcache.base import PrefixCache
from kvstrata.kvcache.digest import CacheDigest
from kvstrata.kvcache.page_index import L1PageIndex
from kvstrata.kvcache.radix import RadixCache

# Chained page hashes of a request's first `num_pages` full pages, computed lazily (only
# tiers that key pages by hash pay for them).
HashSource = Callable[[int], list[bytes]]

if TYPE_CHECKING:
    from kvstrata.kvcache.l3_io import L3Job
    from kvstrata.kvcache.retention import Retention


class PendingRead(NamedTuple):
    """A request's L3 prefetch that has not landed in L2 yet: it asked for the pages
    [first_page, first_page + len(page_hashes)) of the request's chain, of which L3 holds
    the leading `num_present` (None until L3 answered that, before any bytes move)."""

    first_page: int
    page_hashes: list[bytes]
    num_present: int | None
    deadline_s: float | None  # the prefetch policy's bound on the wait (None: none)
    job: L3Job

    @property
    def landed(self) -> bool:
        """The read finished and the engine thread indexed what arrived (`poll`)."""
        return self.job.collected


class TieredCache(Protocol):
    # Read-only to callers (properties here, so an implementation may hold a narrower
    # type: HiRadixCache's L1 is a RadixCache, its digest always exists).
    @property
    def l1(self) -> PrefixCache: ...

    @property
    def digest(self) -> CacheDigest | None:
        """The prefixes servable from L1/L2 at chunk boundaries, for cache-aware routing;
        kept current by the tiers' own page events. None when there is no prefix cache."""
        ...

    def match(self, token_ids: Sequence[int], hashes: HashSource) -> TierMatch:
        """The cached prefix of `token_ids` (page-aligned) across tiers. Nothing is locked."""
        ...

    def lock(self, match: TierMatch) -> None:
        """Pin every tier's part of `match` so nothing evicts it."""
        ...

    def unlock(self, match: TierMatch) -> None: ...

    def fence_loads(self) -> None:
        """Later compute work runs after every copy into L1 so far (restores, L3 loads):
        called before a batch that may read such pages."""
        ...

    def restore(
        self, token_ids: Sequence[int], match: TierMatch, hashes: HashSource
    ) -> PrefixMatch:
        """Bring the L2 part of a locked match into L1. The caller has made
        `len(match.host_page_ids)` L1 pages free. Returns the L1 match covering the whole
        `match.prefix_len`, locked; `match` itself is unlocked."""
        ...

    def insert(self, token_ids: Sequence[int], page_ids: Sequence[int], hashes: HashSource) -> None:
        """Hand full pages to the cache (see `PrefixCache.insert`)."""
        ...

    def retain(self, token_ids: Sequence[int], retention: Retention, hashes: HashSource) -> None:
        """The cached pages of `token_ids` in every tier keep the stronger of their hint
        and `retention` (see `PrefixCache.retain`)."""
        ...

    def reset_retention(
        self, token_ids: Sequence[int], keep_len: int, retention: Retention, hashes: HashSource
    ) -> None:
        """The cached pages of `token_ids` past `keep_len`, in every tier, take
        `retention` in place of their hint (see `PrefixCache.reset_retention`)."""
        ...

    def start_prefetch(self, rid: str, token_ids: Sequence[int], hashes: HashSource) -> None:
        """Begin fetching pages beyond the L1/L2 match from L3 (if any)."""
        ...

    def prefetch_ready(self, rid: str) -> bool:
        """True when the request may be admitted, by the prefetch policy."""
        ...

    def end_prefetch(self, rid: str) -> None:
        """The request was admitted or went away: stop waiting for its prefetch."""
        ...

    def pending_read(self, rid: str) -> PendingRead | None:
        """The request's prefetch read while it has not landed; None otherwise."""
        ...

    def load_into(self, page_hashes: Sequence[bytes], l1_page_ids: Sequence[int]) -> int:
        """Copy the leading pages of `page_hashes` that L2 holds into the caller's own
        L1 pages (not the cache's): the number copied. For pages read from L3 while their
        request's prompt transfer ran."""
        ...

    def poll(self) -> None:
        """Collect finished background I/O (called once per engine step)."""
        ...

    def flush(self) -> None:
        """Drop L1 and L2 (never L3). Only when nothing is locked."""
        ...

    def metrics(self) -> dict[str, float]:
        """Tier counters for /metrics (empty when there are no tiers beyond L1)."""
        ...

    def close(self) -> None:
        """Finish background I/O and release storage connections."""
        ...

    def clear_l3(self) -> int | None:
        """Delete this namespace's pages from L3; None when there is no L3."""
        ...

    def check_integrity(self) -> list[str]:
        """Violations of every tier's own invariants (empty: sound): the L1 cache and its
        allocator, the L1 page index, the digest, and (HiRadixCache) L2 and the L3 jobs.
        Engine thread, between two steps. What requests hold is not seen here."""
        ...

    def prefetch_rids(self) -> list[str]:
        """Requests that may still wait for their L3 prefetch (until admitted or gone):
        each must be live (engine/invariants.py checks)."""
        ...

    def invariant_counts(self) -> dict[str, int]:
        """The tiers beyond L1 for the invariants report, by name: L2 pages by state and
        the L3 prefetches waited for (empty: L1 only). Engine thread, between two steps."""
        ...


class L1Tiers:
    """Only L1: matches come straight from the prefix cache, nothing to restore."""

    def __init__(self, l1: PrefixCache) -> None:
        self.l1 = l1
        self.digest: CacheDigest | None = None
        self.l1_index: L1PageIndex | None = None  # None: a cache with no pages to name
        if isinstance(l1, RadixCache):
            self.digest = CacheDigest(l1.page_size)
            self.l1_index = L1PageIndex(l1, self.digest, on_evict=None)

    def match(self, token_ids: Sequence[int], hashes: HashSource) -> TierMatch:
        return TierMatch(self.l1.match_prefix(token_ids))

    def lock(self, match: TierMatch) -> None:
        self.l1.lock(match.l1.handle)

    def unlock(self, match: TierMatch) -> None:
        self.l1.unlock(match.l1.handle)

    def fence_loads(self) -> None:
        pass

    def restore(
        self, token_ids: Sequence[int], match: TierMatch, hashes: HashSource
    ) -> PrefixMatch:
        return match.l1

    def insert(self, token_ids: Sequence[int], page_ids: Sequence[int], hashes: HashSource) -> None:
        if self.l1_index is None:
            self.l1.insert(token_ids, page_ids)
        else:
            self.l1_index.insert(token_ids, page_ids, hashes)

    def retain(self, token_ids: Sequence[int], retention: Retention, hashes: HashSource) -> None:
        self.l1.retain(token_ids, retention)

    def reset_retention(
        self, token_ids: Sequence[int], keep_len: int, retention: Retention, hashes: HashSource
    ) -> None:
        self.l1.reset_retention(token_ids, keep_len, retention)

    def start_prefetch(self, rid: str, token_ids: Sequence[int], hashes: HashSource) -> None:
        pass

    def prefetch_ready(self, rid: str) -> bool:
        return True

    def end_prefetch(self, rid: str) -> None:
        pass

    def pending_read(self, rid: str) -> PendingRead | None:
        return None

    def load_into(self, page_hashes: Sequence[bytes], l1_page_ids: Sequence[int]) -> int:
        return 0

    def poll(self) -> None:
        pass

    def flush(self) -> None:
        if self.l1_index is None:
            self.l1.reset()
        else:
            self.l1_index.reset()
        if self.digest is not None:
            self.digest.clear()

    def metrics(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass

    def clear_l3(self) -> int | None:
        return None

    def check_integrity(self) -> list[str]:
        violations = self.l1.check_integrity()
        if self.l1_index is not None and self.digest is not None:
            violations += self.l1_index.check_integrity() + self.digest.check_integrity()
        return violations

    def prefetch_rids(self) -> list[str]:
        return []

    def invariant_counts(self) -> dict[str, int]:
        return {}
