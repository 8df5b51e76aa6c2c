"""A request's L1 pages over its life: attach a matched prefix, grow page by page,
and on finish, abort or preemption hand full pages to the prefix cache and free the rest.
The only place that moves pages between the allocator, the cache and requests."""

from __future__ import annotations

from kvstrata.core import PrefixMatch, Request
from kvstrata.kvcache.base import PrefixCache
from kvstrata.kvcache.pages import PageAllocator


class RequestKV:
    def __init__(self, allocator: PageAllocator, cache: PrefixCache, page_size: int) -> None:
        self.allocator = allocator
        self.cache = cache
        self.page_size = page_size

    def num_pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    @property
    def num_available_pages(self) -> int:
        """Pages that could be handed out now: free plus evictable from the cache."""
        return self.allocator.num_free_pages + self.cache.num_evictable_pages

    def match(self, req: Request) -> PrefixMatch:
        # At least one token must be computed to produce logits, so the last known
        # token is never served from the cache.
        return self.cache.match_prefix(req.token_ids[: req.num_tokens - 1])

    def try_attach(self, req: Request, match: PrefixMatch, end: int, reserve_pages: int) -> bool:
        """Give `req` the matched prefix plus pages for tokens [prefix_len, end).

        Succeeds only if, after that, `reserve_pages` would still be available (room
        for running requests to grow). On failure nothing changes."""
        self.cache.lock(match.handle)
        num_new_pages = self.num_pages_for(end) - match.num_pages
        if num_new_pages + reserve_pages > self.num_available_pages:
            self.cache.unlock(match.handle)
            return False
        self._make_free(num_new_pages)
        req.cache_handle = match.handle
        req.page_ids = list(match.page_ids) + self.allocator.alloc(num_new_pages)
        req.num_computed_tokens = match.prefix_len
        if req.num_preemptions == 0:
            req.num_cached_tokens = match.prefix_len
        return True

    def try_grow(self, req: Request, end: int) -> bool:
        """Ensure `req` holds pages for tokens [0, end); False (and no change) if L1
        cannot supply them even after evicting every unlocked cached page."""
        num_new_pages = self.num_pages_for(end) - len(req.page_ids)
        if num_new_pages <= 0:
            return True
        if num_new_pages > self.num_available_pages:
            return False
        self._make_free(num_new_pages)
        req.page_ids.extend(self.allocator.alloc(num_new_pages))
        return True

    def release(self, req: Request) -> None:
        """Return every page of `req`: full pages of computed KV go to the prefix cache
        (so a later turn or a re-admission can hit them), the partial tail is freed."""
        num_full_pages = req.num_computed_tokens // self.page_size
        full_len = num_full_pages * self.page_size
        self.cache.insert(req.token_ids[:full_len], req.page_ids[:num_full_pages])
        self.allocator.free(req.page_ids[num_full_pages:])
        if req.cache_handle is not None:
            self.cache.unlock(req.cache_handle)
        req.cache_handle = None
        req.page_ids = []
        req.num_computed_tokens = 0

    def _make_free(self, num_pages: int) -> None:
        shortfall = num_pages - self.allocator.num_free_pages
        if shortfall > 0:
            self.cache.evict(shortfall)
