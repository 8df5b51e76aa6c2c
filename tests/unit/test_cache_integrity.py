"""check_integrity of every kvcache component that owns pages, locks or nodes: normal use
(alloc, insert, evict, lock, unlock, L2 write-back, L3 write and prefetch, restore, and an
engine's traffic) reports nothing; each deliberately corrupted state is reported, naming
the component."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from kvstrata import LLM, SamplingParams
from kvstrata.kvcache.copier import TorchCopier
from kvstrata.kvcache.hashing import page_hashes
from kvstrata.kvcache.hicache_policy import PrefetchPolicy, WritePolicy
from kvstrata.kvcache.hiradix import HiRadixCache
from kvstrata.kvcache.host import HostCache
from kvstrata.kvcache.host_pool import HostPool
from kvstrata.kvcache.l3_io import L3IO
from kvstrata.kvcache.nocache import NoPrefixCache
from kvstrata.kvcache.pages import KVPool, PageAllocator
from kvstrata.kvcache.radix import RadixCache
from kvstrata.kvcache.storage.file import FileStorage
from kvstrata.kvcache.tiers import HashSource, L1Tiers, TieredCache

PAGE = 2
SEED = b"\x02" * 32
A = [1, 2, 3, 4, 5, 6]  # 3 pages
B = [1, 2, 9, 9]  # shares A's first page


def hashes(tokens: list[int]) -> HashSource:
    return lambda num_pages: page_hashes(tokens, PAGE, SEED)[:num_pages]


def fill(tiers: TieredCache, tokens: list[int]) -> None:
    """What the engine does for a finished request: match, allocate the rest, insert."""
    match = tiers.match(tokens, hashes(tokens))
    allocator = tiers.l1.allocator
    page_ids = match.l1.page_ids + allocator.alloc(len(tokens) // PAGE - match.l1.num_pages)
    tiers.insert(tokens, page_ids, hashes(tokens))


def with_prefix(violations: list[str], prefix: str) -> list[str]:
    return [v for v in violations if v.startswith(prefix)]


# ---- L1: the allocator, the radix tree, the no-op cache, the page index --------------


def test_allocator_reports_double_listing_and_stray_flags() -> None:
    allocator = PageAllocator(4)
    page_ids = allocator.alloc(2)
    allocator.free(page_ids[:1])
    assert allocator.check_integrity() == []
    allocator._free.append(allocator._free[0])
    assert with_prefix(allocator.check_integrity(), "page allocator: pages listed free twice")
    allocator.reset()
    allocator.alloc(1)
    allocator._is_free[0] = True  # allocated, but flagged free: a later free would pass
    assert with_prefix(allocator.check_integrity(), "page allocator: flagged free but not listed")


def test_radix_normal_use_is_sound_and_lock_corruption_is_seen() -> None:
    tiers = L1Tiers(RadixCache(PageAllocator(8), PAGE))
    fill(tiers, A)
    fill(tiers, B)  # splits A's node after its first page
    match = tiers.match(A, hashes(A))
    tiers.lock(match)
    assert tiers.check_integrity() == []
    assert tiers.l1.evict(8) == 1  # only B's own page is on no locked path
    assert tiers.check_integrity() == []
    node = match.l1.handle
    node.lock_count += 1  # a lock on the leaf that its ancestors do not count
    violations = tiers.check_integrity()
    assert with_prefix(violations, "radix: children hold 2 locks")
    node.lock_count -= 1
    tiers.unlock(match)
    assert tiers.check_integrity() == []
    node.lock_count = -1
    assert with_prefix(tiers.check_integrity(), "radix: negative lock count")


def test_radix_reports_pages_cached_twice_freed_or_miscounted() -> None:
    allocator = PageAllocator(8)
    cache = RadixCache(allocator, PAGE)
    cache.insert(A, allocator.alloc(3))
    node = cache.match_prefix(A).handle
    node.page_ids[1] = node.page_ids[0]
    assert with_prefix(cache.check_integrity(), "radix: page 0 cached twice")
    allocator = PageAllocator(8)
    cache = RadixCache(allocator, PAGE)
    cache.insert(A, allocator.alloc(3))
    allocator.free([0])  # behind the cache's back
    assert with_prefix(cache.check_integrity(), "radix: page 0 is cached but free")
    cache._num_cached_pages += 1
    assert with_prefix(cache.check_integrity(), "radix: 3 pages in the tree, counter says 4")


def test_allocator_faults_reach_the_cache_report_as_l1() -> None:
    allocator = PageAllocator(4)
    cache = NoPrefixCache(allocator, PAGE)
    cache.insert(A[:4], allocator.alloc(2))  # handed straight back
    assert cache.check_integrity() == []
    allocator._free.pop()
    assert with_prefix(cache.check_integrity(), "L1 page allocator: flagged free but not listed")


def test_no_prefix_cache_reports_unbalanced_locks() -> None:
    tiers = L1Tiers(NoPrefixCache(PageAllocator(4), PAGE))
    match = tiers.match(A, hashes(A))
    tiers.lock(match)
    tiers.unlock(match)
    assert tiers.check_integrity() == []
    tiers.l1._num_locks = -1
    assert tiers.check_integrity() == ["no prefix cache: -1 locks outstanding"]


def test_page_index_must_cover_exactly_the_tree() -> None:
    tiers = L1Tiers(RadixCache(PageAllocator(8), PAGE))
    fill(tiers, A)
    assert tiers.l1_index is not None and tiers.digest is not None
    assert tiers.check_integrity() == []
    # A page the tree caches but the index never heard of: an insert past the tiers.
    allocator = tiers.l1.allocator
    tiers.l1.insert([7, 7], allocator.alloc(1))
    assert with_prefix(tiers.check_integrity(), "L1 page index: cached pages with no hash")
    tiers.flush()
    fill(tiers, A)
    page_id = tiers.l1.match_prefix(A).page_ids[0]
    tiers.l1_index._page_of_hash[tiers.l1_index.hash_of(page_id)] = page_id + 1
    assert with_prefix(tiers.check_integrity(), "L1 page index: pages whose hash names another")


def test_digest_reports_a_wrong_depth() -> None:
    tiers = L1Tiers(RadixCache(PageAllocator(8), PAGE))
    fill(tiers, A)
    assert tiers.digest is not None
    tiers.digest._depth[page_hashes(A, PAGE, SEED)[2]] = 0
    assert with_prefix(tiers.check_integrity(), "digest: wrong depth")


# ---- L2 and L3: HostCache and HiRadixCache ---------------------------------------------


class Tiers:
    """A HiRadixCache over tiny real pools, with file-backed L3 when `l3_dir` is given."""

    def __init__(self, policy: str, l3_dir: Path | None = None, num_l2: int = 8) -> None:
        l1_pool = KVPool(8, PAGE, 2, 1, 2, torch.float32, "cpu")
        l2_pool = HostPool(num_l2, PAGE, 2, 1, 2, torch.float32, pin_memory=False)
        self.host = HostCache(PageAllocator(num_l2))
        self.radix = RadixCache(PageAllocator(8), PAGE)
        l3 = None
        if l3_dir is not None:
            l3 = L3IO(FileStorage(l3_dir, l2_pool.page_bytes, SEED), l2_pool, num_threads=1)
        self.cache = HiRadixCache(
            self.radix, self.host, TorchCopier(l1_pool, l2_pool), WritePolicy.named(policy),
            l3, PrefetchPolicy("wait_complete", 0.0, 0.0, 0),
        )  # fmt: skip


def test_host_cache_reports_reader_and_page_corruption() -> None:
    t = Tiers("write_through")
    fill(t.cache, A)
    assert t.host.check_integrity() == [] and t.cache.check_integrity() == []
    t.host._num_read_pages += 1
    assert with_prefix(t.host.check_integrity(), "L2: 0 pages have readers, counter says 1")
    t.host._num_read_pages -= 1
    t.host.allocator.free([t.host.indexed_page_ids()[0]])
    violations = t.cache.check_integrity()
    assert with_prefix(violations, "L2: indexed pages that are free in the allocator")
    assert with_prefix(violations, "hicache: L2 ")  # free + indexed + reserved != total


def test_hiradix_write_back_restore_and_locked_matches_are_sound() -> None:
    t = Tiers("write_back")
    fill(t.cache, A)
    assert t.radix.evict(2) == 2  # backed up to L2 on eviction
    assert t.cache.check_integrity() == []
    match = t.cache.match(A, hashes(A))
    assert len(match.host_page_ids) == 2
    t.cache.lock(match)  # pins two L2 pages: sound while the match is locked
    assert t.cache.check_integrity() == []
    restored = t.cache.restore(A, match, hashes(A))
    assert t.cache.check_integrity() == []
    t.radix.unlock(restored.handle)
    assert t.cache.check_integrity() == []
    t.host.add_reader(page_hashes(A, PAGE, SEED)[1:2])  # a pin no copy, write or match owns
    assert with_prefix(t.cache.check_integrity(), "hicache: 1 L2 reader pins")


def test_hiradix_l3_writes_and_prefetches_are_sound_and_job_tables_checked(
    tmp_path: Path,
) -> None:
    t = Tiers("write_through", tmp_path / "l3")
    fill(t.cache, A)  # backed up to L2 and written through to L3 in the background
    assert t.cache.check_integrity() == []  # the write may still be in flight
    t.cache.wait_io()
    assert t.cache.check_integrity() == []
    t.cache.flush()
    t.cache.start_prefetch("r1", A, hashes(A))
    assert t.cache.reserved_host_page_ids()
    assert t.cache.check_integrity() == []  # the read may still be in flight
    t.cache.wait_io()
    assert t.cache.prefetch_ready("r1")
    assert t.cache.check_integrity() == []
    match = t.cache.match(A, hashes(A))
    assert match.l3_len == 6
    t.cache.lock(match)
    t.radix.unlock(t.cache.restore(A, match, hashes(A)).handle)
    t.cache.end_prefetch("r1")
    assert t.cache.check_integrity() == []

    t.cache.flush()
    t.cache.start_prefetch("r2", A, hashes(A))
    t.cache._read_parent.clear()  # a pending read that lost its parent hash
    assert with_prefix(t.cache.check_integrity(), "hicache: 0 read parents for 1 pending reads")
    t.host.allocator.free(t.cache.reserved_host_page_ids()[:1])  # under the read's feet
    assert with_prefix(t.cache.check_integrity(), "hicache: L2 pages reserved by a read but free")
    t.cache._reads.clear()  # the read is gone but neither landed nor was collected
    violations = t.cache.check_integrity()
    assert with_prefix(violations, "hicache: prefetch of r2 waits for a read that is gone")
    assert with_prefix(violations, "hicache: L2 ")  # its reserved pages leaked
    t.cache.close()


# ---- the engine's own tiers ---------------------------------------------------------------

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def test_engine_tiers_stay_sound_through_eviction_l2_l3_and_flush(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """L1 holds about two requests: every round evicts, backs up to L2, writes to L3, and
    after the flush reads back through L3 prefetches."""
    rng = random.Random(0)
    prompts = [[rng.randrange(500) for _ in range(40)] for _ in range(4)]
    llm = LLM(
        str(tiny_llama), page_size=4, num_kv_pages=24, enable_hierarchical_cache=True,
        hicache_ratio=2, hicache_write_policy="write_back", hicache_storage_backend="file",
        hicache_storage_dir=str(tmp_path / "l3"), hicache_storage_prefetch_policy="wait_complete",
        hicache_prefetch_threshold=4,
    )  # fmt: skip
    tiers = llm.engine.tiers
    for round_index in range(3):
        for prompt in prompts:
            llm.generate(input_ids=[prompt], sampling_params=GREEDY)
            assert tiers.check_integrity() == []
        if round_index == 1:
            assert llm.engine.flush_cache()
            assert tiers.check_integrity() == []
    assert tiers.stats.evicted_pages_l1 > 0 and tiers.stats.hit_tokens_l3 > 0
