"""A request's KV pages over its life: match its prefix across tiers, attach it (restoring
L2/L3 pages into L1), grow page by page, and on finish, abort or preemption hand full
pages to the cache and free the rest. The only place that moves pages between the
allocator, the caches and requests."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence

from kvstrata.core import Request, ScheduledRequest, TierMatch
from kvstrata.kvcache.pages import PageAllocator
from kvstrata.kvcache.retention import Retention
from kvstrata.kvcache.sessions import SessionTable
from kvstrata.kvcache.tiers import HashSource, TieredCache


class RequestKV:
    def __init__(
        self,
        allocator: PageAllocator,
        tiers: TieredCache,
        page_size: int,
        namespace: bytes,
        sessions: SessionTable | None = None,
    ) -> None:
        self.allocator = allocator
        self.tiers = tiers
        # Agent sessions (kvcache/sessions.py): a turn's released pages keep its
        # session's retention. Its owner; the engine tells it when turns start and end.
        self.sessions = sessions
        self.cache = tiers.l1
        self.page_size = page_size
        self.namespace = namespace
        # Requests whose pages a transfer is reading: never preempted (their pages would go
        # back to the cache under the reader) until unpinned.
        self._pinned: set[str] = set()
        # The last batch's requests, and those that got pages loaded from L3 since
        # (before_batch: which batches must wait for copies into L1).
        self._last_batch_rids: frozenset[str] = frozenset()
        self._loaded_rids: set[str] = set()

    def num_pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    @property
    def num_available_pages(self) -> int:
        """L1 pages that could be handed out now: free plus evictable from the cache."""
        return self.allocator.num_free_pages + self.cache.num_evictable_pages

    def hashes(self, req: Request) -> HashSource:
        """The request's chained page hashes, extended on demand and kept on the request
        (pages are append-only, so a full page's hash never changes)."""
        return self.hash_chain(lambda: req.token_ids, req.page_hashes)

    def hash_chain(self, tokens: Callable[[], Sequence[int]], chain: list[bytes]) -> HashSource:
        """The chained page hashes of `tokens()`, computed on demand into `chain`."""
        from kvstrata.kvcache.hashing import page_hashes

        def first(num_pages: int) -> list[bytes]:
            if len(chain) < num_pages:
                start = len(chain) * self.page_size
                new_tokens = tokens()[start : num_pages * self.page_size]
                prev = chain[-1] if chain else None
                chain.extend(page_hashes(new_tokens, self.page_size, self.namespace, prev))
            return chain[:num_pages]

        return first

    def match(self, req: Request, whole_prompt: bool = False) -> TierMatch:
        """The cached prefix across tiers. Unless `whole_prompt` (PD decode, where the
        prefill rank produces the first token), at least one token must be computed to
        produce logits, so the last known token is never served from the cache."""
        end = req.num_tokens if whole_prompt else req.num_tokens - 1
        if req.params.prompt_logprobs is not None:
            # Positions whose prompt logprobs are missing must be computed, not cached.
            end = min(end, len(req.prompt_logprobs))
        return self.tiers.match(req.token_ids[:end], self.hashes(req))

    def start_prefetch(self, req: Request) -> None:
        self.tiers.start_prefetch(req.rid, req.token_ids[: req.num_tokens - 1], self.hashes(req))

    def prefetch_ready(self, req: Request) -> bool:
        return self.tiers.prefetch_ready(req.rid)

    def try_attach(self, req: Request, match: TierMatch, end: int, reserve_pages: int) -> bool:
        """Give `req` its matched prefix (restored into L1) plus pages for tokens
        [prefix_len, end).

            [0, l1_len) L1 hit | [l1_len, prefix_len) load-back from L2 | [prefix_len, end) new

        Succeeds only if, after that, `reserve_pages` would still be available (room
        for running requests to grow). On failure nothing changes."""
        self.tiers.lock(match)
        num_new_pages = self.num_pages_for(end) - match.l1.num_pages
        if num_new_pages + reserve_pages > self.num_available_pages:
            self.tiers.unlock(match)
            return False
        self.attach_locked(req, match, end)
        return True

    def attach_locked(self, req: Request, match: TierMatch, end: int) -> None:
        """`try_attach` for a match the caller already locked and made room for."""
        self.make_free(self.num_pages_for(end) - match.l1.num_pages)
        l1 = self.tiers.restore(req.token_ids, match, self.hashes(req))
        req.cache_handle = l1.handle
        req.page_ids = list(l1.page_ids) + self.allocator.alloc(
            self.num_pages_for(end) - l1.num_pages
        )
        req.num_computed_tokens = match.prefix_len
        if req.admitted_s is None:  # a timestamp for request tracing
            req.admitted_s = time.monotonic()
        if req.num_preemptions == 0:
            req.num_cached_tokens = match.prefix_len
            req.num_cached_tokens_l2 = match.l2_len
            req.num_cached_tokens_l3 = match.l3_len
        self.tiers.end_prefetch(req.rid)

    def try_grow(self, req: Request, end: int) -> bool:
        """Ensure `req` holds pages for tokens [0, end); False (and no change) if L1
        cannot supply them even after evicting every unlocked cached page."""
        if end <= len(req.page_ids) * self.page_size:
            return True  # most calls: a decode step inside its last page
        num_new_pages = self.num_pages_for(end) - len(req.page_ids)
        if num_new_pages > self.num_available_pages:
            return False
        self.make_free(num_new_pages)
        req.page_ids.extend(self.allocator.alloc(num_new_pages))
        return True

    def release(self, req: Request) -> None:
        """Return every page of `req`: full pages of computed KV go to the cache (so a
        later turn or a re-admission can hit them), the partial tail is freed."""
        assert req.cache_handle is not None, f"release of {req.rid}, which holds no lock"
        num_full_pages = req.num_computed_tokens // self.page_size
        full_len = num_full_pages * self.page_size
        self.tiers.insert(req.token_ids[:full_len], req.page_ids[:num_full_pages], self.hashes(req))
        params = req.params
        if params.cache_priority or params.cache_retention_s is not None:
            hint = Retention(params.cache_priority, params.cache_retention_s)
            self.tiers.retain(req.token_ids[:full_len], hint, self.hashes(req))
        if params.session is not None and self.sessions is not None:
            self.sessions.pages_released(params.session, req.token_ids[:full_len], self.hashes(req))
        self.allocator.free(req.page_ids[num_full_pages:])
        self.cache.unlock(req.cache_handle)
        req.cache_handle = None
        req.page_ids = []
        req.num_computed_tokens = 0

    def before_batch(self, items: Sequence[ScheduledRequest]) -> None:
        """Fence the copies into L1 before a batch that may read them: one with a request
        that was not in the last batch (it may hold restored pages, or match some) or that
        got pages loaded since. A batch of the last one's requests reads none of them
        (copies go to newly allocated pages), so decode steps never wait on another
        request's restore."""
        rids = frozenset(item.request.rid for item in items)
        if not rids <= self._last_batch_rids or not rids.isdisjoint(self._loaded_rids):
            self.tiers.fence_loads()
            self._loaded_rids.clear()
        self._last_batch_rids = rids

    def mark_computed(self, req: Request, end: int) -> None:
        """The KV of tokens [0, end) is now in `req`'s pages (a step or a transfer wrote
        it)."""
        req.num_computed_tokens = end

    def count_restored(self, req: Request, num_tokens: int) -> None:
        """`num_tokens` more of `req`'s prompt KV were restored from L3 into its own pages:
        they count as computed and as an L3 cache hit."""
        self._loaded_rids.add(req.rid)
        req.num_computed_tokens += num_tokens
        req.num_cached_tokens += num_tokens
        req.num_cached_tokens_l3 += num_tokens

    def hand_over(self, req: Request) -> Request:
        """Move `req`'s pages and prefix lock to a stand-in (returned), which releases them
        later; `req` is left with none, to start again."""
        stand_in = copy.copy(req)
        req.page_ids, req.cache_handle, req.num_computed_tokens = [], None, 0
        return stand_in

    def pin(self, req: Request) -> None:
        self._pinned.add(req.rid)

    def unpin(self, req: Request) -> None:
        self._pinned.discard(req.rid)

    def is_pinned(self, req: Request) -> bool:
        return req.rid in self._pinned

    @property
    def pinned_rids(self) -> frozenset[str]:
        return frozenset(self._pinned)

    def check_integrity(self) -> list[str]:
        """Violations of the pages' own owners: the cache tiers and their allocators
        (empty: sound). What requests hold, and that pins name page holders, is the
        rank-wide accounting of engine/invariants.py."""
        return self.tiers.check_integrity()

    def forget(self, req: Request) -> None:
        """A request that never got pages went away: drop its pending prefetch."""
        self.tiers.end_prefetch(req.rid)

    def make_free(self, num_pages: int) -> None:
        """Evict from the cache until `num_pages` are free (callers checked they can be)."""
        shortfall = num_pages - self.allocator.num_free_pages
        if shortfall > 0:
            self.cache.evict(shortfall)
