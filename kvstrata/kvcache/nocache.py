"""NoPrefixCache: the prefix cache used with `disable_radix_cache`. It caches nothing:
every match is empty and every inserted page goes straight back to the allocator."""

from __future__ import annotations

from collections.abc import Sequence

from kvstrata.core import CacheHandle, PrefixMatch
from kvstrata.kvcache.base import PrefixCache
from kvstrata.kvcache.pages import PageAllocator


class _EmptyHandle(CacheHandle):
    """The one handle NoPrefixCache hands out (not None, so `handle is None` can still
    mean 'no match taken' in the engine)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<NoPrefixCache empty handle>"


_EMPTY_HANDLE = _EmptyHandle()


class NoPrefixCache(PrefixCache):
    """Holds no pages. Still counts locks, so an unbalanced unlock or a reset while
    requests run fails the same way it would with a real cache."""

    def __init__(self, allocator: PageAllocator, page_size: int) -> None:
        super().__init__(allocator, page_size)
        self._num_locks = 0  # outstanding lock() calls; all share the one empty handle

    @property
    def num_cached_pages(self) -> int:
        return 0

    @property
    def num_locked_pages(self) -> int:
        return 0

    def match_prefix(self, token_ids: Sequence[int]) -> PrefixMatch:
        return PrefixMatch(prefix_len=0, page_ids=[], handle=_EMPTY_HANDLE)

    def lock(self, handle: CacheHandle) -> None:
        self._check_handle(handle)
        self._num_locks += 1

    def unlock(self, handle: CacheHandle) -> None:
        self._check_handle(handle)
        if self._num_locks < 1:
            raise RuntimeError("unlock of a handle that is not locked")
        self._num_locks -= 1

    @property
    def num_lock_pins(self) -> int:
        return self._num_locks

    def path_page_ids(self, handle: CacheHandle) -> list[int]:
        self._check_handle(handle)
        return []

    def check_locks(self, handles: Sequence[CacheHandle]) -> list[str]:
        if self._num_locks != len(handles):
            return [f"L1: {self._num_locks} lock(s) held, live requests hold {len(handles)}"]
        return []

    def insert(self, token_ids: Sequence[int], page_ids: Sequence[int]) -> int:
        self._check_insert_len(token_ids, page_ids)
        self.allocator.free(page_ids)
        return 0

    def evict(self, num_pages: int) -> int:
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        return 0

    def reset(self) -> None:
        if self._num_locks > 0:
            raise RuntimeError(f"reset of a prefix cache with {self._num_locks} lock(s) held")

    def _check_cache(self) -> list[str]:
        if self._num_locks < 0:
            return [f"no prefix cache: {self._num_locks} locks outstanding"]
        return []

    @staticmethod
    def _check_handle(handle: CacheHandle) -> None:
        if handle is not _EMPTY_HANDLE:
            raise TypeError(f"not a NoPrefixCache handle: {handle!r}")
