"""Agent sessions in the cache tiers, exactly (issue 34, parts 2-4): a paused session's
pages are demoted to L2 under pressure instead of dropped (and the digest moves them to
L2, so a router prices the resume right), a closed sub-agent's own pages go first, the L2
eviction order follows the hints, the paused retention decays, and through the engine a
resumed turn finds its whole history in L2 after pressure, or in L1 after a prefetch."""

from __future__ import annotations

from pathlib import Path

from kvstrata import LLM, SamplingParams
from kvstrata.config.sessions import SessionOptions
from kvstrata.core import SessionRef
from kvstrata.kvcache.digest import TIER_L2
from kvstrata.kvcache.hashing import page_hashes
from kvstrata.kvcache.hicache_policy import PrefetchPolicy, WritePolicy
from kvstrata.kvcache.hiradix import HiRadixCache
from kvstrata.kvcache.host import HostCache
from kvstrata.kvcache.pages import PageAllocator
from kvstrata.kvcache.radix import RadixCache
from kvstrata.kvcache.retention import EVICT_FIRST, NO_RETENTION, HeldHint, Retention
from kvstrata.kvcache.sessions import SessionTable
from kvstrata.kvcache.tiers import HashSource
from kvstrata.sim.cache import NullCopier

PAGE = 2
SEED = b"\x02" * 32


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


class Tiers:
    """A HiRadixCache over metadata-only pages (the simulator's copier), a fake clock,
    and a session table on it."""

    def __init__(
        self, policy: str = "priority", num_l1: int = 8, num_l2: int = 8, queued_priority: int = 0
    ) -> None:
        self.clock = Clock()
        self.allocator = PageAllocator(num_l1)
        self.radix = RadixCache(self.allocator, PAGE, policy, clock=self.clock)
        self.host = HostCache(PageAllocator(num_l2), clock=self.clock)
        self.cache = HiRadixCache(
            self.radix,
            self.host,
            NullCopier(),
            WritePolicy.named("write_through_selective"),  # no copy to L2 but demotion
            None,
            PrefetchPolicy("best_effort", 0.0, 0.0, 0),
        )
        options = SessionOptions(
            paused_priority=50, paused_retention_s=60.0, queued_priority=queued_priority
        )
        self.sessions = SessionTable(self.cache, options)
        self.cache.digest.delta_since(PAGE, None, None)  # a router's poll: a page per chunk

    def turn(self, session: SessionRef | None, tokens: list[int]) -> None:
        """A turn of `session` (None: a request outside any session) whose full pages
        end up cached: its unmatched pages are new."""
        if session is not None:
            self.sessions.turn_started(session)
        matched = self.radix.match_prefix(tokens).num_pages
        page_ids = self.radix.match_prefix(tokens).page_ids
        page_ids += self.allocator.alloc(len(tokens) // PAGE - matched)
        self.cache.insert(tokens, page_ids, hashes(tokens))
        if session is not None:
            self.sessions.pages_released(session, tokens, hashes(tokens))
            self.sessions.turn_ended(session)
        self.clock.now_s += 1

    def l2_tokens(self, tokens: list[int]) -> int:
        return self.cache.match(tokens, hashes(tokens)).l2_len


def hashes(tokens: list[int]) -> HashSource:
    return lambda num_pages: page_hashes(tokens, PAGE, SEED)[:num_pages]


def seq(first: int, num_pages: int) -> list[int]:
    return list(range(first, first + num_pages * PAGE))


def test_a_paused_session_is_demoted_not_dropped() -> None:
    agent = seq(1000, 4)
    for with_session in (True, False):
        t = Tiers()
        t.turn(SessionRef("agent") if with_session else None, agent)
        t.turn(None, seq(2000, 4))  # newer, unhinted
        assert t.radix.evict(8) == 8  # everything: L1 needs the room
        if with_session:
            # the unhinted pages went first and were dropped; the session's were copied
            assert t.cache.stats.demoted_pages_l1 == 4
            assert t.l2_tokens(agent) == len(agent)
            tiers = {t.cache.digest.entries[h] for h in page_hashes(agent, PAGE, SEED)}
            assert tiers == {TIER_L2}  # the router sees the resume will come from L2
            assert t.l2_tokens(seq(2000, 4)) == 0
        else:
            assert t.cache.stats.demoted_pages_l1 == 0
            assert t.l2_tokens(agent) == 0
        assert t.cache.check_integrity() == []


def test_a_queued_turns_context_goes_after_paused_ones() -> None:
    """With --session-queued-priority, a session whose next turn has arrived keeps its
    context over a paused session's, however recent; once that turn ends it is paused
    like the others (recency among them again)."""
    a, b, c = SessionRef("a"), SessionRef("b"), SessionRef("c")
    ctx_a, ctx_b, ctx_c = seq(1000, 4), seq(2000, 4), seq(3000, 4)
    for queued_priority in (0, 60):  # the second run goes on below
        t = Tiers(queued_priority=queued_priority)
        t.turn(a, ctx_a)  # the older
        t.turn(b, ctx_b)
        t.sessions.turn_started(a)  # a's next turn arrived: it waits in the queue
        assert t.radix.evict(4) == 4
        gone = ctx_b if queued_priority else ctx_a
        assert t.radix.match_prefix(gone).prefix_len == 0
        kept = ctx_a if queued_priority else ctx_b
        assert t.radix.match_prefix(kept).prefix_len == len(kept)
    t.sessions.pages_released(a, ctx_a, hashes(ctx_a))
    t.sessions.turn_ended(a)
    t.turn(c, ctx_c)  # newer than a's last hit, both paused now
    assert t.radix.evict(4) == 4
    assert t.radix.match_prefix(ctx_a).prefix_len == 0  # the older paused one went
    assert t.radix.match_prefix(ctx_c).prefix_len == len(ctx_c)
    assert t.cache.check_integrity() == []


def test_the_paused_retention_decays() -> None:
    t = Tiers()
    t.turn(SessionRef("agent"), seq(1000, 4))
    t.turn(None, seq(2000, 4))
    t.clock.now_s += 61  # past the paused retention without a hit: plain recency again
    assert t.radix.evict(4) == 4
    assert t.radix.match_prefix(seq(1000, 4)).prefix_len == 0  # the older one went
    assert t.radix.match_prefix(seq(2000, 4)).prefix_len == 8
    assert t.cache.stats.demoted_pages_l1 == 0


def test_a_closed_sub_agents_own_pages_go_first() -> None:
    t = Tiers(num_l1=12)
    parent_ctx = seq(1000, 3)
    t.turn(SessionRef("parent"), parent_ctx)
    t.turn(None, seq(2000, 3))  # older than the child's pages, unhinted
    child = SessionRef("child", parent_id="parent", final=True)
    child_ctx = parent_ctx + seq(3000, 3)  # the parent's context, then its own
    t.turn(child, child_ctx)  # its final turn: closed
    assert t.sessions.info("child").state == "closed"  # type: ignore[union-attr]
    assert t.radix.evict(3) == 3
    # its own 3 pages went (EVICT_FIRST), not the older unhinted ones nor the parent's
    assert t.radix.match_prefix(child_ctx).prefix_len == len(parent_ctx)
    assert t.radix.match_prefix(seq(2000, 3)).prefix_len == 6
    assert t.cache.stats.demoted_pages_l1 == 0  # not retained: dropped, not demoted
    assert t.cache.check_integrity() == []


def test_closing_keeps_what_a_live_session_shares() -> None:
    t = Tiers(num_l1=12)
    shared = seq(1000, 2)
    t.turn(SessionRef("a"), shared + seq(2000, 2))
    t.turn(SessionRef("b", parent_id="a"), shared + seq(3000, 2))
    t.turn(None, seq(4000, 2))
    t.sessions.close("b")
    assert t.radix.evict(2) == 2  # b's own two pages; the shared ones stay a's
    assert t.radix.match_prefix(shared + seq(3000, 2)).prefix_len == len(shared)
    assert t.radix.match_prefix(shared + seq(2000, 2)).prefix_len == 8
    assert t.radix.match_prefix(seq(4000, 2)).prefix_len == 4


def test_the_table_forgets_the_least_recent_beyond_its_token_bound() -> None:
    t = Tiers(num_l1=12)
    t.sessions = SessionTable(t.cache, SessionOptions(max_session_tokens=10))
    t.turn(SessionRef("old"), seq(1000, 4))  # 8 tokens
    t.turn(SessionRef("new"), seq(2000, 4))  # 16 in all: "old" is forgotten
    assert t.sessions.info("old") is None and t.sessions.info("new") is not None
    assert t.sessions.stats.sessions_forgotten == 1
    assert t.sessions.context_of("new") == seq(2000, 4)


def test_l2_evicts_by_retention_then_recency() -> None:
    clock = Clock()
    host = HostCache(PageAllocator(3), clock=clock)
    names = [b"a" * 32, b"b" * 32, b"c" * 32]
    for name, page_id in zip(names, host.alloc(3), strict=True):
        host.add_chain([name], [page_id])
        clock.now_s += 1
    host.retain([names[0]], Retention(10, 5.0))  # the oldest, but retained
    host.reset_retention([names[2]], EVICT_FIRST)  # the newest, but evict-first
    assert host.evict(1) == 1 and names[2] not in host
    assert host.evict(1) == 1 and names[1] not in host  # unhinted before retained
    clock.now_s += 10  # the retention lapsed: now it can go like any other
    assert host.num_hinted_pages == 1
    assert host.evict(1) == 1 and names[0] not in host
    assert host.num_hinted_pages == 0 and host.check_integrity() == []


def test_l2_places_a_demoted_page_by_its_last_hit() -> None:
    """A page L1 evicted is as old as its last hit there, not new: LRU order across both
    tiers (exact order), and a hit makes it the newest."""
    clock = Clock()
    host = HostCache(PageAllocator(4), clock=clock)
    a, b, c, d = (bytes([i]) * 32 for i in range(4))
    for name in (a, b, c):
        host.add_chain([name], host.alloc(1))
        clock.now_s += 1
    host.add_chain([d], host.alloc(1), hint=HeldHint(NO_RETENTION, last_access_s=100.5))
    assert host.evict(1) == 1 and a not in host and d in host
    assert host.evict(1) == 1 and d not in host and b in host
    clock.now_s += 1
    host.add_chain([a], host.alloc(1))
    host.match([b])  # b: newest now
    host.evict(1)
    assert c not in host and b in host and a in host
    assert host.check_integrity() == []


def test_a_demotion_displaces_only_l2_pages_worth_less() -> None:
    """Pages L1 evicts take L2 room from pages of lower priority or older hits, never from
    ones worth more: with nothing worth less they are dropped (the least valuable of both
    tiers), and a chain gets its head placed first."""
    clock = Clock()
    host = HostCache(PageAllocator(3), clock=clock)
    kept, old, recent = (bytes([i]) * 32 for i in range(3))
    host.add_chain([kept], host.alloc(1), hint=HeldHint(Retention(50), last_access_s=90.0))
    host.add_chain([old], host.alloc(1), hint=HeldHint(NO_RETENTION, last_access_s=95.0))
    host.add_chain([recent], host.alloc(1))  # hit at 100
    assert host.alloc_displacing(2, HeldHint(NO_RETENTION, last_access_s=93.0)) == []
    assert all(h in host for h in (kept, old, recent))
    page_ids = host.alloc_displacing(2, HeldHint(NO_RETENTION, last_access_s=99.0))
    assert len(page_ids) == 1 and old not in host and kept in host and recent in host
    host.allocator.free(page_ids)
    page_ids = host.alloc_displacing(3, HeldHint(Retention(50), last_access_s=89.0))
    assert len(page_ids) == 2 and recent not in host and kept in host  # 50 at 90 > 50 at 89
    assert host.check_integrity() == []


def test_l2_evicts_a_chain_from_its_tail() -> None:
    """Pages indexed or hit together as one chain go tail first, so what stays is a prefix
    a later match can still use."""
    clock = Clock()
    host = HostCache(PageAllocator(6), clock=clock)
    chain_x = [bytes([1, i]) * 16 for i in range(3)]
    chain_y = [bytes([2, i]) * 16 for i in range(3)]
    host.add_chain(chain_x, host.alloc(3))
    clock.now_s += 1
    host.add_chain(chain_y, host.alloc(3))
    clock.now_s += 1
    assert host.evict(2) == 2
    assert [h in host for h in chain_x] == [True, False, False]
    assert len(host.match(chain_x)) == 1  # the head, still a usable prefix
    clock.now_s += 1
    assert host.evict(2) == 2  # y is older than x's hit head now: y's tail goes first
    assert [h in host for h in chain_y] == [True, False, False]
    # Demoted together (as L1 evicts one node's pages): tail first at one time too.
    chain_z = [bytes([3, i]) * 16 for i in range(3)]
    host.add_chain(chain_z, host.alloc(3), hint=HeldHint(NO_RETENTION, last_access_s=100.0))
    assert host.evict(1) == 1 and chain_z[2] not in host and chain_z[1] in host
    assert host.check_integrity() == []


# -- through the engine ------------------------------------------------------------------

PROMPT_LEN = 32  # 8 pages of 4 tokens


def tiered_llm(model: Path, **flags: object) -> LLM:
    """L1 of 20 pages of 4 tokens (about two prompts) and L2 that copies only demotions."""
    return LLM(
        str(model),
        page_size=4,
        num_kv_pages=20,
        enable_hierarchical_cache=True,
        hicache_write_policy="write_through_selective",
        **flags,
    )


def test_resumed_turn_finds_its_history_in_l2_then_in_l1_after_prefetch(
    tiny_llama: Path,
) -> None:
    """An agent's turn, then pressure from another request that needs L1; its next turn
    finds its whole history in L2 (demoted, not dropped); after a prefetch, in L1."""
    llm = tiered_llm(tiny_llama, hicache_ratio=4.0)
    engine = llm.engine
    agent = SessionRef("agent-1")
    history = [7 + i for i in range(PROMPT_LEN)]
    turn = SamplingParams(max_tokens=4, temperature=0.0, session=agent)
    plain = SamplingParams(max_tokens=4, temperature=0.0)
    (first,) = llm.generate(input_ids=[history], sampling_params=turn)
    history += first.output_ids
    assert engine.sessions.info("agent-1").state == "paused"  # type: ignore[union-attr]
    # a prompt that needs nearly all of L1: the agent's pages must make room
    llm.generate(input_ids=[[100 + i for i in range(2 * PROMPT_LEN)]], sampling_params=plain)
    assert engine.tiers.metrics()["hicache_demoted_pages_l1"] > 0
    # the full pages of computed KV (the last output token's is not computed)
    cached = (PROMPT_LEN + 4 - 1) // 4 * 4
    started = engine.session_prefetch.start("agent-1")
    assert started is not None and started.num_context_tokens == cached
    assert started.num_l2_tokens > 0  # what the pressure demoted
    assert started.num_l1_tokens + started.num_l2_tokens == cached
    assert engine.session_prefetch.stats.prefetched_tokens_l2 == started.num_l2_tokens
    before = engine.tiers.metrics()
    (second,) = llm.generate(input_ids=[[*history, 5, 6, 7, 8]], sampling_params=turn)
    after = engine.tiers.metrics()
    assert second.cached_tokens == cached
    assert after["hicache_hit_tokens_l1"] - before["hicache_hit_tokens_l1"] == cached
    assert after["hicache_hit_tokens_l2"] == before["hicache_hit_tokens_l2"]  # none from L2
    assert engine.session_prefetch.start("nobody") is None
    llm.engine.close()


def test_sessions_beyond_l2_resume_from_l3(tiny_llama: Path, tmp_path: Path) -> None:
    """Six paused sessions retained where L1 and L2 each hold about two: the oldest
    one's pages leave L2 too (demoted in turn, all retained alike), and its next turn
    still finds its whole history, partly in L3, which L2 wrote through to."""
    llm = tiered_llm(
        tiny_llama,
        hicache_ratio=1.0,
        hicache_storage_backend="file",
        hicache_storage_dir=str(tmp_path / "l3"),
        hicache_storage_prefetch_policy="wait_complete",
        hicache_prefetch_threshold=4,
    )
    histories = [[60 * (k + 1) + i for i in range(PROMPT_LEN)] for k in range(6)]
    for k, history in enumerate(histories):
        params = SamplingParams(max_tokens=4, temperature=0.0, session=SessionRef(f"s{k}"))
        (out,) = llm.generate(input_ids=[history], sampling_params=params)
        history += out.output_ids
    llm.engine.tiers.wait_io()  # let the L3 writes land
    cached = (PROMPT_LEN + 4 - 1) // 4 * 4
    params = SamplingParams(max_tokens=2, temperature=0.0, session=SessionRef("s0"))
    (resumed,) = llm.generate(input_ids=[[*histories[0], 1, 2, 3]], sampling_params=params)
    usage = resumed.cache_usage
    assert resumed.cached_tokens == cached, usage
    assert usage.l3_tokens > 0, usage
    assert llm.engine.tiers.metrics()["hicache_evicted_pages_l2"] > 0
    llm.engine.close()
