"""L1PageIndex: the chained hash naming each page the L1 radix tree caches, and the page of
each hash, kept in step with the tree's inserts and evictions, with the L1 page events
they make for the cache digest. Both tiered caches (tiers.py, hiradix.py) compose one."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvstrata.kvcache.digest import TIER_L1, CacheDigest
from kvstrata.kvcache.radix import RadixCache
from kvstrata.kvcache.retention import HeldHint

if TYPE_CHECKING:
    from kvstrata.kvcache.tiers import HashSource

# Told the pages the tree is about to evict, their hashes and the hint they held, after the
# index dropped them and before the digest hears: a copy to L2 made here keeps their
# prefix servable.
EvictHook = Callable[[list[int], list[bytes], HeldHint], None]


class L1PageIndex:
    """Owns the tree's evict listener. Invariant: the two maps are inverse to each other
    and cover exactly the pages the tree caches (a tree page names one whole prefix, so
    one hash). Only the engine thread calls it."""

    def __init__(self, l1: RadixCache, digest: CacheDigest, on_evict: EvictHook | None) -> None:
        self.l1 = l1
        self.digest = digest
        # Both listeners weak: the tree and the hook's owner (HiRadixCache) are held by the
        # same owner as this index, and a strong bound method back would make a cycle.
        self._on_evict = _Weakly(on_evict) if on_evict is not None else None
        self._hash_of_page: dict[int, bytes] = {}
        self._page_of_hash: dict[bytes, int] = {}
        l1.evict_listener = _Weakly(self._evicted)

    def __contains__(self, page_hash: bytes) -> bool:
        """Whether L1 caches the page this hash names."""
        return page_hash in self._page_of_hash

    def hash_of(self, page_id: int) -> bytes:
        return self._hash_of_page[page_id]

    def insert(
        self, token_ids: Sequence[int], page_ids: Sequence[int], hashes: HashSource
    ) -> tuple[list[int], list[bytes]]:
        """`RadixCache.insert`, then index the pages that became cached and report them
        to the digest. Returns those pages and their hashes (empty: all were cached)."""
        first_new = self.l1.insert(token_ids, page_ids) // self.l1.page_size
        if first_new == len(page_ids):
            return [], []
        chain = hashes(len(page_ids))
        new_page_ids, new_hashes = list(page_ids[first_new:]), chain[first_new:]
        for page_id, page_hash in zip(new_page_ids, new_hashes):
            self._hash_of_page[page_id] = page_hash
            self._page_of_hash[page_hash] = page_id
        self.digest.add_chain(TIER_L1, new_hashes, chain[first_new - 1] if first_new else None)
        return new_page_ids, new_hashes

    def reset(self) -> None:
        """Drop the tree (`RadixCache.reset`) and the index with it; the digest is the
        owner's to clear."""
        self.l1.reset()
        self._hash_of_page.clear()
        self._page_of_hash.clear()

    def check_integrity(self) -> list[str]:
        violations = []
        if len(self._hash_of_page) != len(self._page_of_hash):
            violations.append(
                f"L1 page index: {len(self._hash_of_page)} pages -> hash, "
                f"{len(self._page_of_hash)} hashes -> page"
            )
        unpaired = sorted(
            page_id
            for page_id, page_hash in self._hash_of_page.items()
            if self._page_of_hash.get(page_hash) != page_id
        )
        if unpaired:
            violations.append(f"L1 page index: pages whose hash names another: {unpaired[:10]}")
        cached = self.l1.cached_page_ids()
        unindexed = sorted(cached - self._hash_of_page.keys())
        if unindexed:
            violations.append(f"L1 page index: cached pages with no hash: {unindexed[:10]}")
        stale = sorted(self._hash_of_page.keys() - cached)
        if stale:
            violations.append(f"L1 page index: hashes for pages not cached: {stale[:10]}")
        return violations

    def _evicted(self, page_ids: list[int], hint: HeldHint) -> None:
        hashes = [self._hash_of_page.pop(page_id) for page_id in page_ids]
        for page_hash in hashes:
            del self._page_of_hash[page_hash]
        if self._on_evict is not None:
            self._on_evict(page_ids, hashes, hint)
        self.digest.remove(TIER_L1, hashes)


class _Weakly:
    """Calls a bound method while its object lives (afterwards, nothing)."""

    def __init__(self, method: Callable[..., None]) -> None:
        self._method = weakref.WeakMethod(method)

    def __call__(self, *args: Any) -> None:
        method = self._method()
        if method is not None:
            method(*args)
