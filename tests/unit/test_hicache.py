"""HiRadixCache on CPU, exact: tier transitions under each write policy, load-back
allocation and locking, L2 eviction order, page accounting in every tier, and the
correctness invariant through L1 -> L2 -> L1."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from kvstrata import LLM, SamplingParams
from kvstrata.kvcache.copier import TorchCopier
from kvstrata.kvcache.hashing import page_hashes
from kvstrata.kvcache.hicache_policy import PrefetchPolicy, WritePolicy
from kvstrata.kvcache.hiradix import HiRadixCache
from kvstrata.kvcache.host import HostCache
from kvstrata.kvcache.host_pool import HostPool
from kvstrata.kvcache.pages import KVPool, OutOfPages, PageAllocator
from kvstrata.kvcache.radix import RadixCache
from kvstrata.kvcache.tiers import HashSource

PAGE = 2
SEED = b"\x01" * 32


class Tiers:
    """A HiRadixCache over tiny real pools (2 layers, 1 KV head, head_dim 2)."""

    def __init__(
        self, policy: str, num_l1: int = 8, num_l2: int = 6, inclusive: bool = False
    ) -> None:
        self.l1_pool = KVPool(num_l1, PAGE, 2, 1, 2, torch.float32, "cpu")
        self.l2_pool = HostPool(num_l2, PAGE, 2, 1, 2, torch.float32, pin_memory=False)
        self.allocator = PageAllocator(num_l1)
        self.host = HostCache(PageAllocator(num_l2))
        self.radix = RadixCache(self.allocator, PAGE)
        self.cache = HiRadixCache(
            self.radix,
            self.host,
            TorchCopier(self.l1_pool, self.l2_pool),
            WritePolicy.named(policy),
            None,
            PrefetchPolicy("best_effort", 0.0, 0.0, 0),
            inclusive=inclusive,
        )

    def fill(self, tokens: list[int]) -> list[int]:
        """Allocate L1 pages for `tokens`, write recognisable KV (the token id) into
        them and insert them; returns the page ids."""
        page_ids = self.allocator.alloc(len(tokens) // PAGE)
        for i, page_id in enumerate(page_ids):
            for layer in range(2):
                page_tokens = torch.tensor(tokens[i * PAGE : (i + 1) * PAGE], dtype=torch.float32)
                self.l1_pool.k_cache[layer][page_id] = page_tokens.view(PAGE, 1, 1) + layer
                self.l1_pool.v_cache[layer][page_id] = -page_tokens.view(PAGE, 1, 1) - layer
        self.cache.insert(tokens, page_ids, hashes(tokens))
        return page_ids

    def kv_of(self, page_id: int) -> torch.Tensor:
        return torch.stack([self.l1_pool.k_cache[0][page_id], self.l1_pool.v_cache[1][page_id]])

    def expected_kv(self, tokens: list[int], page_index: int) -> torch.Tensor:
        t = torch.tensor(tokens[page_index * PAGE : (page_index + 1) * PAGE], dtype=torch.float32)
        return torch.stack([t.view(PAGE, 1, 1), -t.view(PAGE, 1, 1) - 1]).expand(2, PAGE, 1, 2)

    def assert_accounting(self, num_private_l1: int = 0) -> None:
        assert (
            self.allocator.num_free_pages + self.radix.num_cached_pages + num_private_l1
            == self.allocator.num_total_pages
        )
        assert (
            self.host.allocator.num_free_pages + self.host.num_cached_pages
            == self.host.allocator.num_total_pages
        )
        self.radix.check_invariants()


def hashes(tokens: list[int]) -> HashSource:
    return lambda num_pages: page_hashes(tokens, PAGE, SEED)[:num_pages]


A = [1, 2, 3, 4, 5, 6]  # 3 pages
B = [7, 8, 9, 10]  # 2 pages


def test_write_through_backs_up_on_insert() -> None:
    t = Tiers("write_through")
    t.fill(A)
    assert t.host.num_cached_pages == 3
    assert all(h in t.host for h in page_hashes(A, PAGE, SEED))
    t.assert_accounting()


def test_write_back_backs_up_only_on_eviction_and_keeps_l2_copy() -> None:
    t = Tiers("write_back")
    t.fill(A)
    assert t.host.num_cached_pages == 0
    assert t.radix.evict(3) == 3
    assert t.host.num_cached_pages == 3  # L1 evicted, the prefix lives on in L2
    match = t.cache.match(A, hashes(A))
    assert (match.l1_len, match.l2_len, match.l3_len) == (0, 6, 0)
    t.assert_accounting()


def test_write_through_selective_waits_for_second_hit() -> None:
    t = Tiers("write_through_selective")
    t.fill(A)
    for expected_l2_pages in (0, 3):  # the first hit does not back up, the second does
        match = t.cache.match(A, hashes(A))
        t.cache.lock(match)
        restored = t.cache.restore(A, match, hashes(A))
        t.radix.unlock(restored.handle)
        assert t.host.num_cached_pages == expected_l2_pages
    t.radix.evict(3)
    assert t.host.num_cached_pages == 3  # selective never copies on eviction itself
    t.assert_accounting()


def test_load_back_allocates_locks_and_restores_bytes() -> None:
    t = Tiers("write_through")
    t.fill(A)
    t.radix.evict(2)  # drop the last two pages from L1; all three stay in L2
    for layer in range(2):  # stale KV in freed pages must not pass for restored KV
        for page_id in range(8):
            if page_id not in t.radix.match_prefix(A).page_ids:
                t.l1_pool.k_cache[layer][page_id].fill_(999.0)
                t.l1_pool.v_cache[layer][page_id].fill_(999.0)
    match = t.cache.match(A, hashes(A))
    assert (match.l1_len, match.l2_len) == (2, 4)
    assert len(match.host_page_ids) == 2
    t.cache.lock(match)
    assert t.host.num_read_pages == 2  # pinned: L2 cannot evict them during the copy
    free_before = t.allocator.num_free_pages
    restored = t.cache.restore(A, match, hashes(A))
    assert t.allocator.num_free_pages == free_before - 2
    assert restored.prefix_len == 6 and restored.num_pages == 3
    assert t.host.num_read_pages == 0
    assert t.radix.num_locked_pages == 3  # the restored path is locked, the old unlocked
    for i, page_id in enumerate(restored.page_ids):
        assert torch.equal(t.kv_of(page_id), t.expected_kv(A, i))
    assert t.radix.evict(10) == 0  # locked: nothing evictable
    t.radix.unlock(restored.handle)
    t.assert_accounting()


def test_l2_evicts_lru_and_never_pages_being_read() -> None:
    t = Tiers("write_back", num_l1=8, num_l2=3)
    t.fill(A)
    t.radix.evict(3)  # A's 3 pages fill L2
    a_hashes = page_hashes(A, PAGE, SEED)
    t.host.add_reader(a_hashes[:1])  # a copy is reading A's first page
    t.fill(B)
    t.radix.evict(2)  # B's 2 pages need 2 L2 pages: the two unread LRU pages go
    assert a_hashes[0] in t.host
    assert a_hashes[1] not in t.host and a_hashes[2] not in t.host
    assert t.host.num_evicted_pages == 2
    with pytest.raises(OutOfPages):
        t.host.alloc(3)  # one page is pinned by a reader: only 2 can be freed
    t.host.remove_reader(a_hashes[:1])
    t.assert_accounting()


def tiers_of(t: Tiers, tokens: list[int]) -> str:
    """Where the chain's pages are (without touching them): "L1", "L2", "L1+L2" or "-"."""
    chain = page_hashes(tokens, PAGE, SEED)
    in_l1, in_l2 = all(h in t.cache.l1_index for h in chain), all(h in t.host for h in chain)
    assert in_l1 or not any(h in t.cache.l1_index for h in chain)  # whole chains here
    assert in_l2 or not any(h in t.host for h in chain)
    return "+".join(["L1"] * in_l1 + ["L2"] * in_l2) or "-"


def test_an_owed_page_whose_copy_an_l3_read_brings_back_is_not_copied_again() -> None:
    """L1 owes L2 a copy of C's pages (L2 was full); an L3 prefetch then indexes their
    copies in L2 (as `L3Jobs` does, here in the room of B's copies, which B now owes):
    the integrity holds, and L1's eviction copies B again but not C, which L2 has."""
    t = Tiers("write_through", num_l1=4, num_l2=4)
    chains = [[10 * c + i for i in range(4)] for c in range(3)]  # A, B, C
    for chain in chains:
        t.radix.evict(max(0, 2 - t.allocator.num_free_pages))
        t.fill(chain)
    assert tiers_of(t, chains[2]) == "L1"  # C owed: L2 holds A and B
    c_hashes = page_hashes(chains[2], PAGE, SEED)
    t.host.evict(2)  # B's copies: they give way first
    c_host_pages = t.host.alloc(2)
    t.host.add_chain(c_hashes, c_host_pages, from_l3=True)
    assert t.cache.check_integrity() == []
    t.radix.evict(4)
    assert t.cache.stats.recopied_pages_l1 == 2  # B's, not C's
    assert tiers_of(t, chains[2]) == "L2" and t.host.match(c_hashes) == c_host_pages
    assert t.cache.check_integrity() == []
    t.assert_accounting()


def restore(t: Tiers, tokens: list[int]) -> None:
    """As the engine admits a request: match, lock, make room in L1, restore; then check
    the restored bytes and unlock."""
    match = t.cache.match(tokens, hashes(tokens))
    t.cache.lock(match)
    t.radix.evict(max(0, len(match.host_page_ids) - t.allocator.num_free_pages))
    restored = t.cache.restore(tokens, match, hashes(tokens))
    for i, page_id in enumerate(restored.page_ids):
        assert torch.equal(t.kv_of(page_id), t.expected_kv(tokens, i))
    t.radix.unlock(restored.handle)


@pytest.mark.parametrize("inclusive", [False, True])
def test_non_inclusive_l2_keeps_l1_plus_l2_distinct_pages(inclusive: bool) -> None:
    """L1 and L2 of 4 pages each, four 2-page chains filled in turn (write_through).
    Inclusive, L2 copies what L1 holds and the oldest chains are lost. Non-inclusive, a
    copy of an L1 page takes only free room (L1 owes the rest) and gives way first, so
    all four chains stay servable; L1 evicting an owed page copies it then, displacing
    only older pages, and every restored byte is the original."""
    t = Tiers("write_through", num_l1=4, num_l2=4, inclusive=inclusive)
    chains = [[10 * c + i for i in range(4)] for c in range(4)]  # A, B, C, D
    for chain in chains:
        t.radix.evict(max(0, 2 - t.allocator.num_free_pages))
        t.fill(chain)
    got = [tiers_of(t, chain) for chain in chains]
    if inclusive:
        assert got == ["-", "-", "L1+L2", "L1+L2"]
        return
    assert got == ["L2", "L2", "L1", "L1"]
    assert t.host.num_shadow_pages == 0 and t.cache.stats.recopied_pages_l1 == 0
    restore(t, chains[0])  # L1 evicts C: copied, displacing B (A is being read)
    assert t.cache.stats.recopied_pages_l1 == 2
    assert [tiers_of(t, chain) for chain in chains] == ["L1+L2", "-", "L2", "L1"]
    assert t.host.num_shadow_pages == 2  # A's copies, which give way first
    restore(t, chains[2])  # L1 evicts D: copied, displacing A's copies
    assert [tiers_of(t, chain) for chain in chains] == ["L1", "-", "L1+L2", "L2"]
    assert t.cache.check_integrity() == []
    t.assert_accounting()


def test_flush_drops_l1_and_l2() -> None:
    t = Tiers("write_through")
    t.fill(A)
    t.cache.flush()
    assert t.radix.num_cached_pages == 0 and t.host.num_cached_pages == 0
    assert t.cache.match(A, hashes(A)).prefix_len == 0
    t.assert_accounting()


GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_prefix_through_l2_gives_identical_output(tiny_llama: Path, policy: str) -> None:
    """L1 holds one request at a time, so every repeat is restored from L2."""
    rng = random.Random(0)
    prompts = [[rng.randrange(500) for _ in range(60)] for _ in range(4)]
    reference = LLM(str(tiny_llama), page_size=4, disable_radix_cache=True)
    expected = [o.output_ids for o in reference.generate(input_ids=prompts, sampling_params=GREEDY)]
    llm = LLM(
        str(tiny_llama), page_size=4, num_kv_pages=40, enable_hierarchical_cache=True,
        hicache_ratio=8, hicache_write_policy=policy,
    )  # fmt: skip
    for round_index in range(2):
        outs = [llm.generate(input_ids=[p], sampling_params=GREEDY)[0] for p in prompts]
        assert [o.output_ids for o in outs] == expected
        for out in outs:
            usage = out.cache_usage
            assert (usage.l1_tokens, usage.l2_tokens, usage.l3_tokens) == (
                (0, 0, 0) if round_index == 0 else (0, 56, 0)
            )
    tiers = llm.engine.tiers
    assert tiers.stats.hit_tokens_l2 == 4 * 56
    load = llm.engine.load()
    assert load.num_used_pages == 0 and llm.engine.cache.num_locked_pages == 0
    assert tiers.host.num_read_pages == 0


@pytest.mark.parametrize("inclusion", ["non_inclusive", "inclusive"])
def test_conversations_beyond_l2_but_within_l1_plus_l2(tiny_llama: Path, inclusion: str) -> None:
    """Five 40-token prompts in turn, twice: 60 pages to keep, L1 and L2 of 40 each.
    Non-inclusive, the second round finds every prompt's whole prefix in L1 or L2;
    inclusive, L2 holds only 40 distinct pages and a cyclic order loses every prefix.
    Outputs equal the reference's either way."""
    rng = random.Random(1)
    prompts = [[rng.randrange(500) for _ in range(40)] for _ in range(5)]
    reference = LLM(str(tiny_llama), page_size=4, disable_radix_cache=True)
    expected = [o.output_ids for o in reference.generate(input_ids=prompts, sampling_params=GREEDY)]
    llm = LLM(
        str(tiny_llama),
        page_size=4,
        num_kv_pages=40,
        enable_hierarchical_cache=True,
        hicache_ratio=1,
        hicache_inclusion=inclusion,
    )
    for _ in range(2):
        outs = [llm.generate(input_ids=[p], sampling_params=GREEDY)[0] for p in prompts]
        assert [o.output_ids for o in outs] == expected
    cached = [o.cache_usage.l1_tokens + o.cache_usage.l2_tokens for o in outs]
    if inclusion == "non_inclusive":
        assert cached == [36] * 5
        assert llm.engine.tiers.stats.recopied_pages_l1 > 0
    else:
        assert cached == [0] * 5
    assert llm.engine.load().num_used_pages == 0
    assert llm.engine.tiers.check_integrity() == []


def test_hierarchical_flags_are_validated(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="--enable-hierarchical-cache"):
        LLM(str(tiny_llama), hicache_storage_backend="file", hicache_storage_dir="/tmp/x")
    with pytest.raises(ValueError, match="--disable-radix-cache"):
        LLM(str(tiny_llama), enable_hierarchical_cache=True, disable_radix_cache=True)
    with pytest.raises(ValueError, match="--hicache-storage-dir"):
        LLM(str(tiny_llama), enable_hierarchical_cache=True, hicache_storage_backend="file")
    with pytest.raises(ValueError, match="--hicache-size"):
        LLM(str(tiny_llama), enable_hierarchical_cache=True, hicache_size=100000.0)
    with pytest.raises(ValueError, match="--hicache-inclusion"):
        LLM(str(tiny_llama), enable_hierarchical_cache=True, hicache_inclusion="exclusive")
    with pytest.raises(ValueError, match="--hicache-write-policy"):
        LLM(str(tiny_llama), enable_hierarchical_cache=True, hicache_write_policy="sometimes")
