"""CacheDigest, exactly: entries follow L1 inserts and evictions, L2 backups keep evicted
prefixes servable, deltas rebuild the router's copy, versions only move on change, and
for random cache histories the router's match equals the real tiers' match in chunks."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstrata.kvcache import digest as digest_module
from kvstrata.kvcache.digest import CacheDigest
from kvstrata.kvcache.digest_wire import TIER_L1, TIER_L2, DigestDelta, DigestReplica
from kvstrata.kvcache.hashing import page_hashes
from kvstrata.kvcache.pages import PageAllocator
from kvstrata.kvcache.radix import RadixCache
from kvstrata.kvcache.tiers import L1Tiers
from kvstrata.sim.cache import RankCache

SEED = bytes(32)
PAGE = 2
CHUNK = 4  # two pages


def chain(tokens: Sequence[int]) -> list[bytes]:
    return page_hashes(tokens, PAGE, SEED)


def source(tokens: Sequence[int]) -> Callable[[int], list[bytes]]:
    hashes = chain(tokens)
    return lambda num_pages: hashes[:num_pages]


def boundaries(tokens: Sequence[int]) -> list[bytes]:
    return chain(tokens)[CHUNK // PAGE - 1 :: CHUNK // PAGE]


def l1_tiers(num_pages: int = 32) -> L1Tiers:
    return L1Tiers(RadixCache(PageAllocator(num_pages), PAGE))


def insert(tiers: L1Tiers, tokens: list[int]) -> None:
    match = tiers.match(tokens, source(tokens))
    num_pages = len(tokens) // PAGE
    page_ids = match.l1.page_ids + tiers.l1.allocator.alloc(num_pages - match.l1.num_pages)
    tiers.insert(tokens, page_ids, source(tokens))


def snapshot(digest: CacheDigest) -> DigestDelta:
    return digest.delta_since(CHUNK, None, None)


def test_l1_inserts_add_every_chunk_boundary_of_every_prefix() -> None:
    tiers = l1_tiers()
    a, b = [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9, 9, 9]
    insert(tiers, a)
    insert(tiers, b)
    assert tiers.digest is not None
    delta = snapshot(tiers.digest)
    assert delta.full and delta.removed == () and delta.added_l2 == ()
    # a: boundaries after 4 and 8 tokens; b shares the first, adds 8 (its 10th token is
    # a partial chunk: no boundary).
    assert set(delta.added_l1) == set(boundaries(a)) | set(boundaries(b))
    assert len(delta.added_l1) == 3 and tiers.digest.num_pages == 4 + 3
    tiers.digest.check_invariants()


def test_deltas_carry_changes_and_versions_move_only_on_change() -> None:
    tiers = l1_tiers(num_pages=8)
    assert tiers.digest is not None
    digest, replica = tiers.digest, DigestReplica()
    a = [1, 2, 3, 4, 5, 6, 7, 8]
    insert(tiers, a)
    # The first ask sets the chunk size: a new epoch, built from the graph, version 0.
    assert replica.apply(snapshot(digest)) and replica.version == 0
    same = digest.delta_since(CHUNK, replica.epoch, replica.version)
    assert (same.full, same.version, same.num_changes) == (False, 0, 0)
    b = [9, 9, 9, 9]
    insert(tiers, b)
    tiers.l1.evict(2)  # LRU: the tail of a (tokens 5-8), i.e. a's second boundary
    delta = digest.delta_since(CHUNK, replica.epoch, replica.version)
    assert (delta.full, delta.base_version, delta.version) == (False, 0, 1)
    assert delta.added_l1 == tuple(boundaries(b)) and delta.removed == (boundaries(a)[1],)
    assert replica.apply(DigestDelta.from_json(delta.to_json()))  # through the wire form
    assert replica.entries == digest.entries == {boundaries(a)[0]: TIER_L1,
                                                 boundaries(b)[0]: TIER_L1}  # fmt: skip
    assert not replica.apply(delta)  # out of sequence now: refused, nothing applied
    assert replica.version == 1


def test_a_foreign_epoch_a_flush_or_a_new_chunk_size_get_a_full_snapshot() -> None:
    tiers = l1_tiers()
    assert tiers.digest is not None
    digest = tiers.digest
    insert(tiers, [1, 2, 3, 4])
    first = snapshot(digest)
    assert digest.delta_since(CHUNK, "another-epoch", first.version).full
    assert digest.delta_since(CHUNK, first.epoch, first.version + 5).full
    tiers.flush()
    after_flush = digest.delta_since(CHUNK, first.epoch, first.version)
    assert after_flush.full and after_flush.num_changes == 0 and after_flush.epoch != first.epoch
    insert(tiers, [1, 2, 3, 4, 5, 6, 7, 8])
    wider = digest.delta_since(2 * CHUNK, after_flush.epoch, after_flush.version)
    assert wider.full and wider.added_l1 == (chain([1, 2, 3, 4, 5, 6, 7, 8])[3],)


def test_versions_older_than_the_kept_history_get_a_snapshot(monkeypatch) -> None:
    monkeypatch.setattr(digest_module, "_HISTORY_CHANGES", 2)
    tiers = l1_tiers()
    assert tiers.digest is not None
    digest = tiers.digest
    base = snapshot(digest)
    for first in range(10, 14):  # four versions of one change each
        insert(tiers, [first, 0, 0, 0])
        digest.delta_since(CHUNK, base.epoch, base.version)
    assert digest.delta_since(CHUNK, base.epoch, base.version).full
    recent = digest.delta_since(CHUNK, base.epoch, digest.version - 1)
    assert not recent.full and recent.num_changes == 1


def test_l2_backups_keep_evicted_prefixes_and_orphans_come_back() -> None:
    # L1 of 4 pages, L2 of 4 pages, write-through: every L1 page is also in L2.
    rank = RankCache(num_l1_pages=4, num_l2_pages=4, page_size=PAGE, l3=None)
    digest = rank.digest
    digest.delta_since(CHUNK, None, None)
    a = [1, 2, 3, 4, 5, 6, 7, 8]
    admission = rank.try_admit(a, source(a), len(a))
    assert admission is not None and admission.l1_len == 0
    rank.release(admission, a, source(a))
    assert digest.entries == dict.fromkeys(boundaries(a), TIER_L1)
    rank.radix.evict(4)  # all of a leaves L1; its L2 copies keep it servable
    assert digest.entries == dict.fromkeys(boundaries(a), TIER_L2)
    match = rank.tiers.match(a, source(a))
    assert (match.l1_len, match.l2_len) == (0, 8)
    # Evict a's second page from L2: everything after it is no longer servable.
    pages = chain(a)
    rank.tiers.host.evict_listener([pages[1]])  # as HostCache.evict reports it
    assert digest.entries == {}
    # The page comes back (computed again into L1): pages 2 and 3, still in L2, follow.
    digest.add_chain(TIER_L1, pages[:2], None)
    assert digest.entries == {pages[1]: TIER_L1, pages[3]: TIER_L2}
    digest.check_invariants()


@st.composite
def histories(draw: st.DrawFn) -> tuple[list[list[int]], list[list[int]]]:
    alphabet = st.integers(0, 2)  # few distinct tokens: prefixes are shared a lot
    seqs = st.lists(alphabet, min_size=2, max_size=16)
    return draw(st.lists(seqs, min_size=1, max_size=12)), draw(st.lists(seqs, max_size=6))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(histories(), st.booleans())
def test_router_match_equals_the_real_match_in_whole_chunks(
    history: tuple[list[list[int]], list[list[int]]], with_l2: bool
) -> None:
    requests, queries = history
    rank = RankCache(num_l1_pages=10, num_l2_pages=12 if with_l2 else 0, page_size=PAGE, l3=None)
    replica = DigestReplica()
    for tokens in requests:
        admission = rank.try_admit(tokens, source(tokens), len(tokens))
        assert admission is not None  # at most 8 pages: always fits
        rank.release(admission, tokens, source(tokens))
        rank.digest.check_invariants()
        delta = rank.digest.delta_since(CHUNK, replica.epoch, replica.version)
        assert replica.apply(delta)
        assert replica.entries == rank.digest.entries
    for tokens in requests + queries:
        real = rank.tiers.match(tokens, source(tokens))
        estimate = replica.match(boundaries(tokens))
        assert estimate.num_chunks == real.prefix_len // CHUNK
        assert estimate.num_l1_chunks == real.l1_len // CHUNK


def test_the_engine_serves_a_digest_the_router_can_match(tiny_llama: Path) -> None:
    import pytest

    from kvstrata import LLM, SamplingParams
    from kvstrata.router.policy import RoutingRequest

    prompt = list(range(100, 120))  # 20 tokens: chunk boundaries after 8 and 16
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm = LLM(str(tiny_llama), page_size=4, num_kv_pages=64, enable_hierarchical_cache=True)
    llm.generate(input_ids=[prompt], sampling_params=params)
    engine = llm.engine
    delta = engine.cache_digest(8)
    assert delta is not None and delta.full and delta.namespace == engine.kv.namespace
    request = RoutingRequest(prompt)
    wanted = request.boundary_hashes(delta.namespace, delta.page_size, delta.chunk_size)
    assert len(wanted) == 2 and set(wanted) <= set(delta.added_l1)
    replica = DigestReplica()
    replica.apply(delta)
    assert replica.match(wanted).num_chunks == 2
    with pytest.raises(ValueError, match="multiple of the page size"):
        engine.cache_digest(6)
    no_cache = LLM(str(tiny_llama), page_size=4, num_kv_pages=64, disable_radix_cache=True)
    assert no_cache.engine.cache_digest(8) is None
