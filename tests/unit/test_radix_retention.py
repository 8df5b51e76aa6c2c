"""Retention hints and the `priority` eviction order of the L1 radix cache, exactly: lower
priority goes first, a priority falls to 0 once its pages went their retention time
without a hit, a hit renews the window, a shared prefix keeps the stronger of its
requests' hints, ties fall back to recency; lru ignores the hints; through the engine a
retained prompt outlives the pressure that evicts it under lru, and the PD wire carries
the hint (issue 34, part 2)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from kvstrata import LLM, SamplingParams
from kvstrata.disagg.wire import WireSampling
from kvstrata.kvcache.pages import PageAllocator
from kvstrata.kvcache.radix import RadixCache
from kvstrata.kvcache.retention import EVICT_FIRST, NO_RETENTION, Retention

PAGE_SIZE = 2


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def make(policy: str = "priority") -> tuple[PageAllocator, RadixCache, Clock]:
    clock = Clock()
    allocator = PageAllocator(32)
    return allocator, RadixCache(allocator, PAGE_SIZE, policy, clock=clock), clock


def put(allocator: PageAllocator, cache: RadixCache, first: int, retention: Retention) -> None:
    """A 4-token (2-page) sequence starting with token `first`, its own leaf."""
    tokens = [first, first + 1, first + 2, first + 3]
    cache.insert(tokens, allocator.alloc(2))
    cache.retain(tokens, retention)


def cached_firsts(cache: RadixCache) -> set[int]:
    return {node.key[0] for node in cache._nodes()}


def test_retention_rules() -> None:
    assert Retention(50, 5.0).effective_priority(5.0) == 50
    assert Retention(50, 5.0).effective_priority(5.1) == 0
    assert Retention(50).effective_priority(1e9) == 50  # no retention time: as long as cached
    assert Retention(60, 1.0).stronger(Retention(50)) == Retention(60, 1.0)  # priority first
    assert Retention(50, 9.0).stronger(Retention(50, 3.0)) == Retention(50, 9.0)
    assert Retention(50, 9.0).stronger(Retention(50)) == Retention(50)  # None is the longest
    # -1 is the cache's own EVICT_FIRST (never a request's: SamplingParams refuses it)
    assert EVICT_FIRST.stronger(NO_RETENTION) == NO_RETENTION
    with pytest.raises(ValueError):
        SamplingParams(cache_priority=-1)
    for bad in ({"priority": -2}, {"priority": 100}, {"retention_s": 0.0}):
        with pytest.raises(ValueError):
            Retention(**bad)  # type: ignore[arg-type]


def test_lower_priority_goes_first_then_decayed_then_recency() -> None:
    allocator, cache, clock = make()
    put(allocator, cache, 10, Retention(10, 5.0))  # oldest
    clock.now_s += 1
    put(allocator, cache, 20, NO_RETENTION)
    clock.now_s += 1
    put(allocator, cache, 30, Retention(10))
    assert cache.evict(2) == 2  # priority 0 goes first, though 10 is older
    assert cached_firsts(cache) == {10, 30}
    clock.now_s += 5  # 10's pages went 7 s without a hit: its priority fell to 0
    assert cache.evict(2) == 2
    assert cached_firsts(cache) == {30}
    cache.check_invariants()


def test_a_hit_renews_the_window() -> None:
    allocator, cache, clock = make()
    put(allocator, cache, 10, Retention(10, 5.0))
    put(allocator, cache, 20, Retention(5))
    clock.now_s += 4
    assert cache.match_prefix([10, 11, 12, 13]).prefix_len == 4  # a hit at 4 s
    clock.now_s += 4  # 8 s since the insert, 4 s since the hit: still priority 10
    assert cache.evict(2) == 2
    assert cached_firsts(cache) == {10}


def test_a_shared_prefix_keeps_the_stronger_hint() -> None:
    allocator, cache, _ = make()
    cache.insert([1, 2, 3, 4], allocator.alloc(2))
    cache.retain([1, 2, 3, 4], Retention(5))
    cache.insert([1, 2, 3, 4, 5, 6], allocator.alloc(3))  # shares [1, 2, 3, 4]
    cache.retain([1, 2, 3, 4, 5, 6], Retention(40))
    put(allocator, cache, 20, Retention(30))
    # The leaf [5, 6] (40) outranks 20's (30); once it is gone, the shared [1..4] kept 40.
    assert cache.evict(2) == 2
    assert cached_firsts(cache) == {1, 5}
    assert cache.evict(1) == 1
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).prefix_len == 2 * PAGE_SIZE
    put(allocator, cache, 30, Retention(20))  # below the 40 the shared prefix kept
    assert cache.evict(2) == 2
    assert cached_firsts(cache) == {1}
    cache.check_invariants()


def test_lru_ignores_the_hints() -> None:
    allocator, cache, _ = make("lru")
    put(allocator, cache, 10, Retention(99))
    put(allocator, cache, 20, NO_RETENTION)
    assert cache.evict(2) == 2
    assert cached_firsts(cache) == {20}


# -- through the engine ------------------------------------------------------------------


PROMPT_LEN = 32  # 8 pages of 4 tokens


def turns_cached(model: Path, policy: str) -> int:
    """One prompt sent with priority 50, then three others that each need its pages (the
    pool holds about two prompts); then the first again: the tokens it found cached."""
    llm = LLM(str(model), page_size=4, num_kv_pages=20, radix_eviction_policy=policy)
    kept = [7 + i for i in range(PROMPT_LEN)]
    others = [[100 * k + i for i in range(PROMPT_LEN)] for k in range(1, 4)]
    retained = SamplingParams(max_tokens=2, temperature=0.0, cache_priority=50)
    plain = SamplingParams(max_tokens=2, temperature=0.0)
    llm.generate(input_ids=[kept], sampling_params=retained)
    for prompt in others:
        llm.generate(input_ids=[prompt], sampling_params=plain)
    (again,) = llm.generate(input_ids=[kept], sampling_params=plain)
    llm.engine.close()
    return again.cached_tokens


def test_a_retained_prompt_outlives_the_pressure_that_evicts_it_under_lru(
    tiny_llama: Path,
) -> None:
    assert turns_cached(tiny_llama, "lru") == 0
    # all but the last page: a prompt computes at least its last token
    assert turns_cached(tiny_llama, "priority") == PROMPT_LEN - 4


def test_bad_hints_are_refused() -> None:
    with pytest.raises(ValueError, match="priority must be in"):
        SamplingParams(cache_priority=100)
    with pytest.raises(ValueError, match="retention_seconds must be > 0"):
        SamplingParams(cache_retention_s=0.0)


def test_the_pd_wire_carries_the_hint_and_refuses_a_bad_one() -> None:
    """A prefill rank (its own cache, prefill HiCache) keeps what the decode rank asked."""
    params = SamplingParams(cache_priority=70, cache_retention_s=30.0)
    sent = json.loads(json.dumps(dataclasses.asdict(params)))
    assert SamplingParams(**WireSampling.model_validate(sent).model_dump()) == params
    for field, bad in (("cache_priority", 100), ("cache_retention_s", -1.0)):
        with pytest.raises(ValidationError, match=field):
            WireSampling.model_validate({**sent, field: bad})
