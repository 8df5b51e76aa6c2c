"""The rank-wide invariants check (engine/invariants.py) through the cache contract: each
cache answers for its own locks with exact results (`path_page_ids`, `check_locks`,
`num_lock_pins`), and the check names each break it claims to catch, on a radix engine
with L2, on one with no prefix cache, and on a PD decode engine."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvstrata import LLM, SamplingParams
from kvstrata.core import Request
from kvstrata.disagg.decode import DecodeHandoff
from kvstrata.engine.engine import Engine
from kvstrata.engine.invariants import check_engine
from kvstrata.kvcache.base import StaleHandle
from kvstrata.kvcache.nocache import NoPrefixCache
from kvstrata.kvcache.pages import PageAllocator
from kvstrata.kvcache.radix import RadixCache

PAGE = 4
SHARED = list(range(100, 120))  # five pages every request below starts with
LONG = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

# ---- the contract, per cache ------------------------------------------------------------


def test_a_radix_cache_answers_for_the_locks_on_its_paths() -> None:
    allocator = PageAllocator(16)
    cache = RadixCache(allocator, page_size=2)
    page_ids = allocator.alloc(3)
    cache.insert([1, 2, 3, 4, 5, 6], page_ids)
    whole = cache.match_prefix([1, 2, 3, 4, 5, 6])
    cache.lock(whole.handle)
    head = cache.match_prefix([1, 2, 3, 4])  # splits the node `whole` ends at
    cache.lock(head.handle)
    assert cache.path_page_ids(whole.handle) == page_ids  # the same after the split
    assert cache.path_page_ids(head.handle) == page_ids[:2]
    assert cache.num_lock_pins == 2
    assert cache.check_locks([whole.handle, head.handle]) == []
    # root, head: 2 locks each, but only one handle crosses them
    assert (
        cache.check_locks([whole.handle])
        == ["L1: a tree node has 2 lock(s), live requests hold 1"] * 2
    )
    assert cache.check_locks([]) == ["L1: a tree node has 2 lock(s), live requests hold 0"]
    other = allocator.alloc(1)
    cache.insert([7, 8], other)
    gone = cache.match_prefix([7, 8])
    assert cache.evict(1) == 1  # the only page on no locked path
    with pytest.raises(StaleHandle):
        cache.path_page_ids(gone.handle)
    assert cache.check_locks([whole.handle, head.handle, gone.handle]) == []
    cache.unlock(head.handle)
    cache.unlock(whole.handle)
    assert (cache.num_lock_pins, cache.check_locks([])) == (0, [])


def test_no_prefix_cache_counts_its_locks_and_holds_no_pages() -> None:
    cache = NoPrefixCache(PageAllocator(4), page_size=2)
    handle = cache.match_prefix([1, 2, 3, 4]).handle
    cache.lock(handle)
    cache.lock(handle)
    assert (cache.path_page_ids(handle), cache.num_lock_pins) == ([], 2)
    assert cache.check_locks([handle, handle]) == []
    assert cache.check_locks([handle]) == ["L1: 2 lock(s) held, live requests hold 1"]
    with pytest.raises(TypeError):
        cache.path_page_ids(RadixCache(PageAllocator(4), 2).match_prefix([]).handle)


# ---- the check, per break ---------------------------------------------------------------


def running_pair(engine: Engine) -> tuple[Request, Request]:
    """Two running requests whose locked paths share SHARED's cached pages."""
    engine.add_request([*SHARED, 1, 2, 3, 4, 5], SHORT)
    while engine.has_unfinished:
        engine.step()
    first = engine.add_request([*SHARED, 7, 8, 9, 10, 11, 12], LONG)
    second = engine.add_request([*SHARED, 13, 14, 15], LONG)
    engine.step()
    assert engine.scheduler.running == [first, second]
    return first, second


def cached_unlocked(engine: Engine, tail: list[int]) -> list[int]:
    """A prompt run to completion: its pages are cached on no locked path."""
    engine.add_request([*tail, *range(1, 13)], SHORT)
    while len(engine.scheduler.running) > 2 or engine.scheduler.waiting:
        engine.step()
    return [*tail, *range(1, 13)]


@pytest.fixture(scope="module")
def radix(tiny_llama: Path) -> Iterator[tuple[Engine, Request, Request]]:
    engine = LLM(
        str(tiny_llama), page_size=PAGE, num_kv_pages=64, enable_hierarchical_cache=True
    ).engine
    yield engine, *running_pair(engine)


Break = Callable[[Engine, Request, Request], Callable[[], object]]  # returns its undo


def _leak(engine: Engine, a: Request, b: Request) -> Callable[[], object]:
    leaked = engine.allocator.alloc(1)
    return lambda: engine.allocator.free(leaked)


def _stray_lock(engine: Engine, a: Request, b: Request) -> Callable[[], object]:
    handle = engine.cache.match_prefix(cached_unlocked(engine, [300, 301, 302, 303])).handle
    engine.cache.lock(handle)
    return lambda: engine.cache.unlock(handle)


def _no_lock(engine: Engine, a: Request, b: Request) -> Callable[[], object]:
    handle, a.cache_handle = a.cache_handle, None

    def undo() -> None:
        a.cache_handle = handle

    return undo


def _stale_lock(engine: Engine, a: Request, b: Request) -> Callable[[], object]:
    handle = engine.cache.match_prefix(cached_unlocked(engine, [400, 401, 402, 403])).handle
    engine.cache.evict(engine.cache.num_evictable_pages)  # `handle`'s node with them
    own, a.cache_handle = a.cache_handle, handle

    def undo() -> None:
        a.cache_handle = own

    return undo


def _swapped_pages(engine: Engine, a: Request, b: Request) -> Callable[[], object]:
    def swap() -> None:
        a.page_ids[0], a.page_ids[-1] = a.page_ids[-1], a.page_ids[0]

    swap()
    return swap


def _append(page_of: Callable[[Request, Request], int], to_b: bool = False) -> Break:
    def do(engine: Engine, a: Request, b: Request) -> Callable[[], object]:
        holder = b if to_b else a
        holder.page_ids.append(page_of(a, b))
        return holder.page_ids.pop

    return do


def _ghost_pin(engine: Engine, a: Request, b: Request) -> Callable[[], object]:
    ghost = copy.copy(a)
    ghost.rid = "ghost"
    engine.kv.pin(ghost)
    return lambda: engine.kv.unpin(ghost)


def _not_live(engine: Engine, a: Request, b: Request) -> Callable[[], object]:
    del engine.requests[a.rid]
    return lambda: engine.requests.__setitem__(a.rid, a)


def _twice_queued(engine: Engine, a: Request, b: Request) -> Callable[[], object]:
    engine.scheduler.waiting.append(a)
    return engine.scheduler.waiting.pop


def _failing_own_check(engine: Engine, a: Request, b: Request) -> Callable[[], object]:
    def broken() -> list[str]:
        raise RuntimeError("too broken to walk")

    engine.scheduler.check_integrity = broken  # type: ignore[method-assign]
    return lambda: delattr(engine.scheduler, "check_integrity")


def _orphan_prefetch(engine: Engine, a: Request, b: Request) -> Callable[[], object]:
    prefetches = engine.tiers._prefetches  # type: ignore[attr-defined]
    prefetches["gone"] = None  # only its request id is read
    return lambda: prefetches.clear()


BREAKS: dict[str, tuple[Break, list[str]]] = {
    "a leaked page": (_leak, ["L1: ", "!= 64 pages"]),
    "a stray lock": (_stray_lock, ["locked pages, but live requests lock", "a tree node has"]),
    "a request without its lock": (_no_lock, ["pages but no lock", "a tree node has"]),
    "a lock on an evicted node": (_stale_lock, ["holds a lock on a node no longer in the tree"]),
    "prefix pages off the path": (_swapped_pages, ["prefix pages are not its locked path's"]),
    "a page held twice": (
        _append(lambda a, b: a.page_ids[-1], to_b=True),
        ["L1 pages held by two requests"],
    ),
    "a page outside the pool": (_append(lambda a, b: 10_000), ["L1 pages outside the pool"]),
    "a page cached and private": (
        _append(lambda a, b: a.page_ids[0]),
        ["both cached and private to a request"],
    ),
    "a pin without pages": (_ghost_pin, ["request ghost is pinned for a transfer"]),
    "a request no longer live": (_not_live, ["running request", "is not a live request"]),
    "a request in two places": (_twice_queued, ["is queued in 2 places"]),
    "an own check that raises": (_failing_own_check, ["scheduler: its integrity check failed"]),
    "an orphan prefetch": (_orphan_prefetch, ["L3 prefetch of gone has no live request"]),
}


@pytest.mark.parametrize("name", BREAKS)
def test_the_check_names_each_break(name: str, radix: tuple[Engine, Request, Request]) -> None:
    engine, a, b = radix
    assert check_engine(engine).ok, check_engine(engine).violations
    do, expected = BREAKS[name]
    undo = do(engine, a, b)
    try:
        violations = check_engine(engine).violations
    finally:
        undo()
    for text in expected:
        assert any(text in v for v in violations), (text, violations)
    report = check_engine(engine)
    assert report.ok and not report.idle, report.violations


def test_a_stray_lock_without_a_prefix_cache(tiny_llama: Path) -> None:
    """NoPrefixCache has no tree, but its locks are still accounted for."""
    engine = LLM(str(tiny_llama), page_size=PAGE, num_kv_pages=64, disable_radix_cache=True).engine
    a, _ = running_pair(engine)
    counts = check_engine(engine).counts
    assert (counts["l1_lock_pins"], counts["l1_cached_pages"]) == (2, 0)
    assert a.cache_handle is not None
    engine.cache.lock(a.cache_handle)
    assert check_engine(engine).violations == ["L1: 3 lock(s) held, live requests hold 2"]
    engine.cache.unlock(a.cache_handle)
    assert check_engine(engine).ok
    for req in list(engine.scheduler.running):
        engine.abort(req.rid)
    assert check_engine(engine).idle


def test_a_zombie_room_whose_request_is_live_again(tiny_llama: Path) -> None:
    decode = LLM(
        str(tiny_llama), page_size=PAGE, disaggregation_mode="decode", num_kv_pages=64,
        disaggregation_decode_local_prefill="never",
    ).engine  # fmt: skip
    role = decode.role
    assert isinstance(role, DecodeHandoff)
    req = decode.add_request(list(range(1, 30)), LONG)
    decode.step()
    role.take_tasks()
    decode.abort(req.rid)  # the client left while the pages were being written
    (room,) = role.zombies
    decode.requests[req.rid] = role.zombies[room]
    violations = check_engine(decode).violations
    assert f"zombie room {room} still has a live request" in violations, violations
    del decode.requests[req.rid]
    assert check_engine(decode).ok
    assert role.release_room(room) and check_engine(decode).idle
