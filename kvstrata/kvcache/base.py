"""The L1 prefix-cache contract: what the engine may ask of a cache of KV pages keyed by
token prefixes, who owns which page when, and what a cache answers about its own locks for
the rank-wide invariants. Implementations: `RadixCache` (radix.py), `NoPrefixCache`."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvstrata.core import CacheHandle, PrefixMatch
    from kvstrata.kvcache.pages import PageAllocator
    from kvstrata.kvcache.retention import Retention


class StaleHandle(ValueError):
    """A handle whose path is no longer in the cache (evicted, or dropped by `reset`): it
    was not locked when that happened, or a lock was lost."""


class PrefixCache(ABC):
    """An index from page-aligned token prefixes to the L1 pages holding their KV.

    Threading: only the engine thread calls any method; there is no internal locking.

    Page ownership:
      - a page is either free (in the allocator), cached (owned by this cache), or private
        to one running request (allocated by the engine, not yet inserted);
      - `insert` takes ownership of every page it is given; the cache alone frees cached
        pages back to the allocator (in `insert`, `evict` and `reset`);
      - pages returned by `match_prefix` stay owned by the cache and are valid only while
        the match's handle is locked: lock it before anything else can evict (in the same
        engine step), read the pages, unlock when the request no longer needs them.
    """

    def __init__(self, allocator: PageAllocator, page_size: int) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.allocator = allocator
        self.page_size = page_size

    @abstractmethod
    def match_prefix(self, token_ids: Sequence[int]) -> PrefixMatch:
        """The longest cached prefix of `token_ids`, rounded down to whole pages.

        Counts as an access (recency and hit count) of every node on the matched path.
        An empty match has `prefix_len == 0`, `page_ids == []` and a handle that `lock` /
        `unlock` still accept, so callers never special-case a miss. Callers that must
        compute at least one token should match `token_ids[:-1]`.
        """

    @abstractmethod
    def lock(self, handle: CacheHandle) -> None:
        """Pin the matched path (every node from the root down to `handle`): locked pages
        are never evicted. Locks nest: each `lock` needs one `unlock`."""

    @abstractmethod
    def unlock(self, handle: CacheHandle) -> None:
        """Undo one `lock` of `handle`. Raises RuntimeError if it is not locked."""

    @abstractmethod
    def insert(self, token_ids: Sequence[int], page_ids: Sequence[int]) -> int:
        """Cache `page_ids`, the pages holding KV for `token_ids` (exactly
        `len(page_ids) * page_size` tokens, else ValueError). Ownership of ALL given
        pages passes to the cache:

            page i's tokens not cached yet          -> page i becomes cached
            cached under the same page id           -> kept (it came from match_prefix)
            cached under a different page id        -> page i is freed to the allocator

        Returns the number of tokens that were already cached before this call. A caller
        still running after `insert` must re-match to learn which pages now hold its KV.
        """

    def retain(self, token_ids: Sequence[int], retention: Retention) -> None:
        """Give the cached pages of `token_ids` the request's `retention` hint (read by the
        `priority` eviction order; a cache without one ignores it)."""
        return

    def reset_retention(
        self, token_ids: Sequence[int], keep_len: int, retention: Retention
    ) -> None:
        """The cached pages of `token_ids` past token `keep_len` take `retention` in
        place of their hint (a closed session's own pages); pages a branch beyond them
        still needs keep the stronger hint. A cache without hints ignores it."""
        return

    @abstractmethod
    def evict(self, num_pages: int) -> int:
        """Free up to `num_pages` cached pages that are on no locked path, to the
        allocator. Returns the number of pages freed: min(num_pages,
        num_evictable_pages) for a cache that evicts at page granularity."""

    @abstractmethod
    def reset(self) -> None:
        """Drop every cached page (all go back to the allocator). Raises RuntimeError if
        anything is locked: running requests would lose their pages."""

    @property
    @abstractmethod
    def num_cached_pages(self) -> int:
        """Pages owned by this cache."""

    @property
    @abstractmethod
    def num_locked_pages(self) -> int:
        """Cached pages on at least one locked path."""

    @property
    def num_evictable_pages(self) -> int:
        """Cached pages on no locked path: what `evict` can free."""
        return self.num_cached_pages - self.num_locked_pages

    # -- what the rank-wide invariants ask (engine/invariants.py); engine thread only,
    # between two steps; each walks only the paths it is given --------------------------

    @abstractmethod
    def path_page_ids(self, handle: CacheHandle) -> list[int]:
        """The pages of the path `handle` names, root first: while it is locked, exactly
        the pages its `match_prefix` returned. Raises StaleHandle if the path is gone."""

    @abstractmethod
    def check_locks(self, handles: Sequence[CacheHandle]) -> list[str]:
        """Violations unless the locks held are exactly one per handle in `handles` (the
        caller's account of its locks: the live requests' handles) on every path they
        name; empty: they are. A stale handle adds nothing (`path_page_ids` names it)."""

    @property
    @abstractmethod
    def num_lock_pins(self) -> int:
        """Outstanding `lock` calls (each `unlock` ends one)."""

    def check_integrity(self) -> list[str]:
        """Violations of this cache's own invariants and of its allocator's (empty: sound).
        Engine thread, between two steps. Pages held by requests are not seen here: the
        rank-wide accounting (free + cached + held = total) is engine/invariants.py's."""
        return [f"L1 {v}" for v in self.allocator.check_integrity()] + self._check_cache()

    @abstractmethod
    def _check_cache(self) -> list[str]:
        """The implementation's own invariants, each message naming the cache."""

    def _check_insert_len(self, token_ids: Sequence[int], page_ids: Sequence[int]) -> None:
        expected_len = len(page_ids) * self.page_size
        if len(token_ids) != expected_len:
            raise ValueError(
                f"insert needs len(token_ids) == len(page_ids) * page_size = "
                f"{len(page_ids)} * {self.page_size} = {expected_len}, got {len(token_ids)}"
            )
