"""Exact tests of the L1 prefix caches (RadixCache, NoPrefixCache, the factory) and a
hypothesis state machine that drives the radix tree like an engine would."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstrata.core import PrefixMatch
from kvstrata.kvcache.factory import make_prefix_cache
from kvstrata.kvcache.nocache import NoPrefixCache
from kvstrata.kvcache.pages import PageAllocator
from kvstrata.kvcache.radix import RadixCache

NUM_PAGES = 16
PAGE_SIZE = 2


def make_cache(eviction_policy: str = "lru") -> tuple[PageAllocator, RadixCache]:
    allocator = PageAllocator(NUM_PAGES)
    return allocator, RadixCache(allocator, PAGE_SIZE, eviction_policy)


def cache_tokens(allocator: PageAllocator, cache: RadixCache, token_ids: list[int]) -> int:
    """A request that computes `token_ids` from scratch and inserts its own pages."""
    page_ids = allocator.alloc(len(token_ids) // PAGE_SIZE)
    return cache.insert(token_ids, page_ids)


def path_lock_counts(handle: Any) -> list[tuple[int, int]]:
    """(key length, lock count) of each node from below the root down to `handle`.
    Handles are opaque to the engine; the tests look inside to check the tree."""
    path = []
    node = handle
    while node.parent is not None:
        path.append((len(node.key), node.lock_count))
        node = node.parent
    return path[::-1]


def freed_order(allocator: PageAllocator, num_freed_pages: int) -> list[int]:
    """The last `num_freed_pages` pages freed, oldest first: the free list is FIFO, so
    draining it shows them at its end."""
    return allocator.alloc(allocator.num_free_pages)[-num_freed_pages:]


# ---- matching ---------------------------------------------------------------------------


def test_empty_cache_gives_empty_match_with_a_lockable_handle() -> None:
    _, cache = make_cache()
    match = cache.match_prefix([1, 2, 3, 4])
    assert (match.prefix_len, match.page_ids) == (0, [])
    cache.lock(match.handle)
    assert cache.num_locked_pages == 0
    cache.unlock(match.handle)
    cache.check_invariants()


def test_match_returns_page_ids_and_rounds_down_to_pages() -> None:
    allocator, cache = make_cache()
    assert cache_tokens(allocator, cache, [1, 2, 3, 4, 5, 6]) == 0  # pages 0, 1, 2

    def match(token_ids: list[int]) -> tuple[int, list[int]]:
        result = cache.match_prefix(token_ids)
        return result.prefix_len, result.page_ids

    assert match([1, 2, 3, 4, 5, 6, 7]) == (6, [0, 1, 2])
    assert match([1, 2, 3, 4, 5]) == (4, [0, 1])  # ends mid-page: rounds down
    assert match([1, 2, 3, 9, 5, 6]) == (2, [0])  # diverges mid-page
    assert match([1, 2, 3, 4, 9, 9]) == (4, [0, 1])  # diverges mid-node: splits it
    assert match([1]) == (0, [])
    assert match([2, 1]) == (0, [])
    assert cache.num_cached_pages == 3
    cache.check_invariants()


# ---- locks --------------------------------------------------------------------------------


def test_lock_counts_along_the_path_survive_a_split() -> None:
    allocator, cache = make_cache()
    cache_tokens(allocator, cache, [1, 2, 3, 4, 5, 6])  # pages 0, 1, 2
    match_a = cache.match_prefix([1, 2, 3, 4, 5, 6])
    cache.lock(match_a.handle)
    assert path_lock_counts(match_a.handle) == [(6, 1)]
    assert (cache.num_locked_pages, cache.num_evictable_pages) == (3, 0)

    # Diverging after two pages splits the node; the new head inherits the lock.
    match_b = cache.match_prefix([1, 2, 3, 4, 7, 8])
    assert match_b.page_ids == [0, 1]
    assert path_lock_counts(match_a.handle) == [(4, 1), (2, 1)]
    cache.lock(match_b.handle)
    assert path_lock_counts(match_a.handle) == [(4, 2), (2, 1)]
    cache.check_invariants()

    cache.unlock(match_a.handle)
    assert path_lock_counts(match_a.handle) == [(4, 1), (2, 0)]
    assert (cache.num_locked_pages, cache.num_evictable_pages) == (2, 1)
    assert cache.evict(NUM_PAGES) == 1  # only the unlocked tail [5, 6]
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).page_ids == [0, 1]

    cache.unlock(match_b.handle)
    assert path_lock_counts(match_b.handle) == [(4, 0)]
    with pytest.raises(RuntimeError, match="not locked"):
        cache.unlock(match_b.handle)
    cache.check_invariants()


def test_unlock_below_zero_raises() -> None:
    _, cache = make_cache()
    with pytest.raises(RuntimeError, match="not locked"):
        cache.unlock(cache.match_prefix([1, 2]).handle)


def test_foreign_and_stale_handles_are_refused() -> None:
    allocator, cache = make_cache()
    with pytest.raises(TypeError):
        cache.lock(None)
    cache_tokens(allocator, cache, [1, 2])
    match = cache.match_prefix([1, 2])
    assert cache.evict(1) == 1  # the handle was not locked, so its node could go
    with pytest.raises(ValueError, match="stale"):
        cache.lock(match.handle)


# ---- insert -------------------------------------------------------------------------------


def test_insert_returns_cached_prefix_len_and_frees_duplicate_pages() -> None:
    allocator, cache = make_cache()
    assert cache_tokens(allocator, cache, [1, 2, 3, 4]) == 0  # pages 0, 1

    # A second request computed the same prefix itself (pages 2, 3) and more (page 4).
    assert allocator.alloc(3) == [2, 3, 4]
    assert cache.insert([1, 2, 3, 4, 5, 6], [2, 3, 4]) == 4
    assert allocator.num_free_pages == NUM_PAGES - 3  # pages 2 and 3 came back
    assert cache.num_cached_pages == 3
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).page_ids == [0, 1, 4]

    # A request that matched [0, 1, 4] hands those ids back with one new page: kept.
    match = cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8])
    cache.lock(match.handle)
    new_page_ids = allocator.alloc(1)
    assert cache.insert([1, 2, 3, 4, 5, 6, 7, 8], match.page_ids + new_page_ids) == 6
    cache.unlock(match.handle)
    assert allocator.num_free_pages == NUM_PAGES - 4
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8]).page_ids == [0, 1, 4, *new_page_ids]
    cache.check_invariants()


def test_insert_diverging_mid_node_splits_and_branches() -> None:
    allocator, cache = make_cache()
    cache_tokens(allocator, cache, [1, 2, 3, 4])  # pages 0, 1
    assert cache_tokens(allocator, cache, [1, 2, 5, 6]) == 2  # pages 2, 3: 2 is freed
    assert cache.match_prefix([1, 2, 3, 4]).page_ids == [0, 1]
    assert cache.match_prefix([1, 2, 5, 6]).page_ids == [0, 3]
    assert cache.num_cached_pages == 3
    cache.check_invariants()


def test_insert_with_wrong_length_raises() -> None:
    allocator, cache = make_cache()
    page_ids = allocator.alloc(2)
    with pytest.raises(ValueError, match="page_size"):
        cache.insert([1, 2, 3], page_ids)
    with pytest.raises(ValueError, match="page_size"):
        cache.insert([1, 2, 3, 4, 5, 6], page_ids)
    assert cache.num_cached_pages == 0


# ---- eviction -----------------------------------------------------------------------------


def test_lru_evicts_least_recently_accessed_leaf_first() -> None:
    allocator, cache = make_cache("lru")
    for token_ids in ([0, 0], [1, 1], [2, 2]):  # A, B, C on pages 0, 1, 2
        cache_tokens(allocator, cache, token_ids)
    cache.match_prefix([0, 0])  # touch A
    assert cache.evict(1) == 1
    assert cache.match_prefix([1, 1]).prefix_len == 0  # B went
    assert cache.match_prefix([0, 0]).prefix_len == 2
    assert cache.evict(NUM_PAGES) == 2
    # B (page 1), then C (page 2, untouched since insert), then A (page 0, touched last).
    assert freed_order(allocator, 3) == [1, 2, 0]


def test_lfu_evicts_fewest_hits_first_ties_by_lru() -> None:
    allocator, cache = make_cache("lfu")
    for token_ids in ([0, 0], [1, 1], [2, 2]):  # A, B, C on pages 0, 1, 2
        cache_tokens(allocator, cache, token_ids)
    cache.match_prefix([2, 2])  # C: 1 hit
    cache.match_prefix([0, 0])  # A: 2 hits
    cache.match_prefix([0, 0])
    cache.match_prefix([1, 1])  # B: 1 hit, more recent than C
    assert cache.evict(NUM_PAGES) == 3
    assert freed_order(allocator, 3) == [2, 1, 0]  # C, B, A (LRU would give C, A, B)


def test_locked_paths_are_never_evicted() -> None:
    allocator, cache = make_cache()
    cache_tokens(allocator, cache, [0, 0, 1, 1])  # pages 0, 1
    cache_tokens(allocator, cache, [3, 3])  # page 2
    match = cache.match_prefix([0, 0, 1, 1])
    cache.lock(match.handle)
    assert cache.num_evictable_pages == 1
    assert cache.evict(NUM_PAGES) == 1
    assert cache.evict(NUM_PAGES) == 0
    assert cache.match_prefix([0, 0, 1, 1]).page_ids == [0, 1]
    assert allocator.num_free_pages == NUM_PAGES - 2
    cache.unlock(match.handle)
    cache.check_invariants()


def test_parent_becomes_evictable_after_its_children() -> None:
    allocator, cache = make_cache()
    cache_tokens(allocator, cache, [1, 2, 5, 6])  # pages 0, 1
    cache_tokens(allocator, cache, [1, 2, 7, 8])  # pages 2, 3: 2 freed, [1, 2] is shared
    assert cache.num_evictable_pages == 3
    # One call: once both leaves are gone the shared head [1, 2] is a leaf and goes too.
    assert cache.evict(NUM_PAGES) == 3
    assert cache.num_cached_pages == 0
    # Page 2 (duplicate, freed by insert), leaves 1 then 3, then the head 0.
    assert freed_order(allocator, 4) == [2, 1, 3, 0]


def test_evicting_fewer_pages_than_a_leaf_trims_its_tail() -> None:
    allocator, cache = make_cache()
    cache_tokens(allocator, cache, [1, 2, 3, 4, 5, 6, 7, 8])  # pages 0..3
    assert cache.evict(1) == 1
    match = cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8])
    assert (match.prefix_len, match.page_ids) == (6, [0, 1, 2])
    assert allocator.num_free_pages == NUM_PAGES - 3
    cache.check_invariants()


def test_reset_drops_everything_but_refuses_while_locked() -> None:
    allocator, cache = make_cache()
    cache_tokens(allocator, cache, [1, 2, 3, 4])
    cache_tokens(allocator, cache, [5, 6])
    match = cache.match_prefix([])  # even an empty match's lock blocks reset
    cache.lock(match.handle)
    with pytest.raises(RuntimeError, match="lock"):
        cache.reset()
    cache.unlock(match.handle)
    cache.reset()
    assert (cache.num_cached_pages, allocator.num_free_pages) == (0, NUM_PAGES)
    assert cache.match_prefix([1, 2, 3, 4]).prefix_len == 0
    cache.check_invariants()


def test_unknown_eviction_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="lru, lfu"):
        RadixCache(PageAllocator(4), PAGE_SIZE, "fifo")
    with pytest.raises(ValueError, match="page_size"):
        RadixCache(PageAllocator(4), 0)


# ---- NoPrefixCache and the factory --------------------------------------------------------


def test_no_prefix_cache_caches_nothing() -> None:
    allocator = PageAllocator(NUM_PAGES)
    cache = make_prefix_cache(allocator, PAGE_SIZE, enabled=False)
    assert isinstance(cache, NoPrefixCache)
    match = cache.match_prefix([1, 2, 3, 4])
    assert (match.prefix_len, match.page_ids) == (0, [])
    cache.lock(match.handle)
    assert cache.insert([1, 2, 3, 4], allocator.alloc(2)) == 0
    assert allocator.num_free_pages == NUM_PAGES
    assert cache.evict(4) == 0
    with pytest.raises(RuntimeError, match="lock"):
        cache.reset()
    cache.unlock(match.handle)
    with pytest.raises(RuntimeError, match="not locked"):
        cache.unlock(match.handle)
    cache.reset()
    with pytest.raises(ValueError, match="page_size"):
        cache.insert([1], [0])
    assert (cache.num_cached_pages, cache.num_locked_pages, cache.num_evictable_pages) == (0, 0, 0)


def test_factory_builds_the_configured_cache() -> None:
    allocator = PageAllocator(NUM_PAGES)
    cache = make_prefix_cache(allocator, PAGE_SIZE, enabled=True, eviction_policy="lfu")
    assert isinstance(cache, RadixCache) and cache.eviction_policy == "lfu"
    assert cache.page_size == PAGE_SIZE
    with pytest.raises(ValueError, match="eviction policy"):
        make_prefix_cache(allocator, PAGE_SIZE, enabled=False, eviction_policy="lrU")


# ---- state machine ------------------------------------------------------------------------


@dataclass
class _RunningRequest:
    """A request the machine keeps running. Its KV for tokens [0, locked_len) lives in
    `locked_page_ids` (cached, pinned by `handle`); the rest in `private_page_ids`."""

    token_ids: list[int]
    handle: object
    locked_page_ids: list[int]
    private_page_ids: list[int]

    @property
    def locked_len(self) -> int:
        return len(self.locked_page_ids) * PAGE_SIZE

    @property
    def num_full_pages(self) -> int:
        return len(self.token_ids) // PAGE_SIZE


class RadixMachine(RuleBasedStateMachine):
    """Random engine traffic over a 4-token vocabulary so prefixes collide often. The
    model `page_tokens` records which tokens' KV each page holds (the whole prefix up to
    its end), written when a request fills the page: a match must only ever return pages
    whose recorded prefix is the one asked for."""

    eviction_policy = "lru"
    num_pages = 24

    def __init__(self) -> None:
        super().__init__()
        self.allocator = PageAllocator(self.num_pages)
        self.cache = RadixCache(self.allocator, PAGE_SIZE, self.eviction_policy)
        self.running: list[_RunningRequest] = []
        self.page_tokens: dict[int, tuple[int, ...]] = {}

    # -- helpers --

    def _check_match(self, token_ids: list[int], match: PrefixMatch) -> None:
        assert match.prefix_len == match.num_pages * PAGE_SIZE <= len(token_ids)
        for index, page_id in enumerate(match.page_ids):
            assert self.page_tokens[page_id] == tuple(token_ids[: (index + 1) * PAGE_SIZE])

    def _alloc(self, num_pages: int) -> list[int] | None:
        shortfall = num_pages - self.allocator.num_free_pages
        if shortfall > 0:
            self.cache.evict(shortfall)
        if self.allocator.num_free_pages < num_pages:
            return None
        return self.allocator.alloc(num_pages)

    def _write_kv(self, request: _RunningRequest) -> None:
        """Record what the request's private pages hold (the last may be partial)."""
        first_private_page = len(request.locked_page_ids)
        for offset, page_id in enumerate(request.private_page_ids):
            end = (first_private_page + offset + 1) * PAGE_SIZE
            self.page_tokens[page_id] = tuple(request.token_ids[:end])

    def _insert_full_pages(self, request: _RunningRequest) -> None:
        """Insert the request's full pages; its private full pages pass to the cache."""
        num_private_full = request.num_full_pages - len(request.locked_page_ids)
        page_ids = request.locked_page_ids + request.private_page_ids[:num_private_full]
        aligned_len = request.num_full_pages * PAGE_SIZE
        prefix_len = self.cache.insert(request.token_ids[:aligned_len], page_ids)
        assert request.locked_len <= prefix_len <= aligned_len
        request.private_page_ids = request.private_page_ids[num_private_full:]

    def _pick(self, data: st.DataObject) -> _RunningRequest:
        return data.draw(st.sampled_from(self.running))

    # -- rules --

    @rule(token_ids=st.lists(st.integers(0, 3), max_size=12))
    def start_request(self, token_ids: list[int]) -> None:
        match = self.cache.match_prefix(token_ids)
        self._check_match(token_ids, match)
        self.cache.lock(match.handle)
        num_pages = -(-len(token_ids) // PAGE_SIZE) - match.num_pages
        private_page_ids = self._alloc(num_pages)
        if private_page_ids is None:  # does not fit even after evicting: reject it
            self.cache.unlock(match.handle)
            return
        request = _RunningRequest(token_ids, match.handle, match.page_ids, private_page_ids)
        self._write_kv(request)
        self.running.append(request)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), token_id=st.integers(0, 3))
    def decode_one_token(self, data: st.DataObject, token_id: int) -> None:
        request = self._pick(data)
        if len(request.token_ids) % PAGE_SIZE == 0:
            new_page_ids = self._alloc(1)
            if new_page_ids is None:
                return
            request.private_page_ids += new_page_ids
        request.token_ids.append(token_id)
        self._write_kv(request)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def cache_running_request(self, data: st.DataObject) -> None:
        """Insert a running request's full pages and move its lock to the longer path."""
        request = self._pick(data)
        self._insert_full_pages(request)
        aligned_len = request.num_full_pages * PAGE_SIZE
        match = self.cache.match_prefix(request.token_ids[:aligned_len])
        assert match.prefix_len == aligned_len
        self._check_match(request.token_ids, match)
        self.cache.lock(match.handle)
        self.cache.unlock(request.handle)
        request.handle, request.locked_page_ids = match.handle, match.page_ids

    @precondition(lambda self: self.running)
    @rule(data=st.data(), aborted=st.booleans())
    def finish_request(self, data: st.DataObject, aborted: bool) -> None:
        request = self._pick(data)
        if not aborted:
            self._insert_full_pages(request)
        self.allocator.free(request.private_page_ids)  # aborted: all; else the partial page
        self.cache.unlock(request.handle)
        self.running.remove(request)

    @rule(num_pages=st.integers(0, 8))
    def evict(self, num_pages: int) -> None:
        num_evictable_pages = self.cache.num_evictable_pages
        assert self.cache.evict(num_pages) == min(num_pages, num_evictable_pages)

    @rule(token_ids=st.lists(st.integers(0, 3), max_size=12))
    def match_only(self, token_ids: list[int]) -> None:
        self._check_match(token_ids, self.cache.match_prefix(token_ids))

    @rule()
    def reset(self) -> None:
        if self.running:  # running requests hold locks (possibly only on the root)
            with pytest.raises(RuntimeError, match="lock"):
                self.cache.reset()
            return
        self.cache.reset()
        assert self.cache.num_cached_pages == 0

    # -- invariants --

    @invariant()
    def pages_are_conserved(self) -> None:
        num_private_pages = sum(len(r.private_page_ids) for r in self.running)
        assert (
            self.allocator.num_free_pages + self.cache.num_cached_pages + num_private_pages
            == self.num_pages
        )

    @invariant()
    def tree_is_consistent(self) -> None:
        self.cache.check_invariants()
        locked_page_ids = {p for r in self.running for p in r.locked_page_ids}
        assert self.cache.num_locked_pages == len(locked_page_ids)

    @invariant()
    def locked_pages_stay_cached(self) -> None:
        for request in self.running:
            match = self.cache.match_prefix(request.token_ids[: request.locked_len])
            assert match.prefix_len == request.locked_len
            assert match.page_ids == request.locked_page_ids


_MACHINE_SETTINGS = settings(
    max_examples=150,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


class RadixMachineLFU(RadixMachine):
    eviction_policy = "lfu"


TestRadixMachineLRU = RadixMachine.TestCase
TestRadixMachineLRU.settings = _MACHINE_SETTINGS
TestRadixMachineLFU = RadixMachineLFU.TestCase
TestRadixMachineLFU.settings = _MACHINE_SETTINGS
