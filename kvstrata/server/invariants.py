"""The invariants of one rank, checked between two engine steps. Each owner of pages, locks
or rooms checks itself (`check_integrity()`: the scheduler, the role, the cache tiers);
what needs all of them is checked here: every L1 page is free, cached or held (nothing
leaked, nothing owned twice), and every request, lock, pin, room and L3 prefetch
belongs to a live request. Served as GET /debug/invariants and as gauges."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvstrata.kvcache.hiradix import HiRadixCache
from kvstrata.kvcache.radix import RadixCache

if TYPE_CHECKING:
    from kvstrata.core import Request
    from kvstrata.engine.engine import Engine
    from kvstrata.server.state import ServerState

# Counts that are zero when nothing is in flight. L3 I/O is not among them: a finished
# background write is only collected by the next engine step, so it may linger at idle.
IN_FLIGHT = (
    "requests", "running", "waiting", "decode_queued", "decode_rooms", "decode_restoring",
    "zombie_rooms", "prefill_rooms", "prefill_sending", "prefill_rooms_http",
    "dispatcher_targets", "dispatcher_active", "prefetches", "l1_held_pages",
    "l1_locked_pages", "l1_lock_pins",
)  # fmt: skip


@dataclass
class InvariantReport:
    violations: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.violations

    @property
    def idle(self) -> bool:
        """Nothing in flight: no request, room, prefetch, lock or request-held page."""
        return all(self.counts.get(name, 0) == 0 for name in IN_FLIGHT)

    def fail(self, message: str) -> None:
        self.violations.append(message)

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok, "idle": self.idle, "violations": self.violations,
            "counts": self.counts,
        }  # fmt: skip


async def rank_invariants(state: ServerState) -> InvariantReport:
    """The engine's invariants (on the engine thread) plus the event loop's PD tables."""
    report = await state.engine_loop.call(check_engine)
    report.counts.update(state.pd_rooms.counts)
    if state.dispatcher is not None:
        report.counts.update(state.dispatcher.counts)
    return report


class InvariantWatch:
    """Owns the last report of the rank's invariants and when it was made. /metrics shows
    it, checking again only once it is `interval_s` old: the full check walks every page
    and lock on the engine thread, which a scrape every few seconds would stall for
    ~0.1 s each at large pools. /debug/invariants always checks (and refreshes it)."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.num_checks = 0
        self._report: InvariantReport | None = None
        self._checked_s = 0.0

    async def check(self, state: ServerState) -> InvariantReport:
        report = await rank_invariants(state)
        self._report, self._checked_s = report, time.monotonic()
        self.num_checks += 1
        return report

    async def for_metrics(self, state: ServerState) -> InvariantReport:
        fresh = time.monotonic() - self._checked_s < self.interval_s
        if self._report is not None and fresh:
            return self._report
        return await self.check(state)


def check_engine(engine: Engine) -> InvariantReport:
    """Engine thread only (`EngineLoop.call`): between two steps, where no allocation,
    lock or room hand-out is half done."""
    report = InvariantReport()
    for name, check in (
        ("scheduler", engine.scheduler.check_integrity),
        ("role", engine.role.check_integrity),
        ("request KV", engine.kv.check_integrity),
    ):
        report.violations += _own_check(name, check)
    holders = _check_requests(engine, report)
    _check_l1(engine, holders, report)
    tiers = engine.tiers
    if isinstance(tiers, HiRadixCache):
        _count_l2(tiers, report)
        prefetch_rids = tiers.prefetch_rids()
        report.counts["prefetches"] = len(prefetch_rids)
        for rid in prefetch_rids:
            if rid not in engine.requests:
                report.fail(f"L3 prefetch of {rid} has no live request")
    report.counts["num_preemptions"] = engine.scheduler.num_preemptions
    return report


def _own_check(name: str, check: Callable[[], list[str]]) -> list[str]:
    """A component's own violations; a check that fails on a structure too broken to
    walk is reported as one, not raised (the report exists to show broken states)."""
    try:
        return check()
    except Exception as e:  # any failure of a check is a finding
        return [f"{name}: its integrity check failed: {e!r}"]


def _check_requests(engine: Engine, report: InvariantReport) -> list[Request]:
    """Every live request is in exactly one place, and no stand-in for an ended one is
    live; returns the requests holding L1 pages (running ones, the role's rooms and
    zombies, finished prefill requests whose pages are being written)."""
    live = engine.requests
    scheduler, role = engine.scheduler, engine.role
    places = scheduler.held_requests() + role.held_requests()
    holders = list(scheduler.running) + role.page_holders()
    for label, req in role.ended_holders().items():
        if live.get(req.rid) is req:
            report.fail(f"{label} still has a live request")
    held = {req.rid for req in holders}
    for rid in sorted(engine.kv.pinned_rids - held):
        report.fail(f"request {rid} is pinned for a transfer but holds no pages")
    report.counts["requests"] = len(live)
    report.counts.update(scheduler.counts)
    report.counts.update(role.counts)
    seen: Counter[str] = Counter()
    for place, req in places:
        seen[req.rid] += 1
        if live.get(req.rid) is not req:
            report.fail(f"{place} request {req.rid} is not a live request")
    for rid in live:
        if seen[rid] != 1:
            report.fail(f"live request {rid} is queued in {seen[rid]} places")
    return holders


def _check_l1(engine: Engine, holders: list[Request], report: InvariantReport) -> None:
    """L1: free + cached + held privately by requests = total; each request's prefix pages
    are the pages of its locked tree path; lock counts are exactly the live requests' pins."""
    cache = engine.cache
    num_total = engine.allocator.num_total_pages
    num_free = engine.allocator.num_free_pages
    num_cached = cache.num_cached_pages
    root = _root(cache)
    pins: Counter[int] = Counter()  # id(node) -> live requests whose path crosses it
    nodes: dict[int, Any] = {} if root is None else {id(root): root}
    held_cached: set[int] = set()  # tree pages on live requests' paths
    private: Counter[int] = Counter()  # pages a request holds outside the tree
    for req in holders:
        if req.cache_handle is None:
            report.fail(f"request {req.rid} holds {len(req.page_ids)} pages but no lock")
        walkable = root is not None and req.cache_handle is not None
        path = _path(req.cache_handle) if walkable else []
        if path and path[0] is not root:
            report.fail(f"request {req.rid} holds a lock on a node no longer in the tree")
        path_pages = [page_id for node in path for page_id in node.page_ids]
        if req.page_ids[: len(path_pages)] != path_pages:
            report.fail(f"request {req.rid}'s prefix pages are not its locked path's pages")
        held_cached.update(path_pages)
        private.update(req.page_ids[len(path_pages) :])
        for node in path:
            pins[id(node)] += 1
            nodes[id(node)] = node
    twice = sorted(page_id for page_id, n in private.items() if n > 1)
    if twice:
        report.fail(f"L1 pages held by two requests: {twice[:10]}")
    outside = sorted(p for p in private if not 0 <= p < num_total)
    if outside:
        report.fail(f"L1 pages outside the pool: {outside[:10]}")
    shared = sorted(held_cached & set(private))
    if shared:
        report.fail(f"L1 pages both cached and private to a request: {shared[:10]}")
    if num_free + num_cached + len(private) != num_total:
        report.fail(
            f"L1: {num_free} free + {num_cached} cached + {len(private)} held by requests "
            f"!= {num_total} pages"
        )
    if cache.num_locked_pages != len(held_cached):
        report.fail(
            f"L1: {cache.num_locked_pages} locked pages, but live requests lock {len(held_cached)}"
        )
    for node_id, node in nodes.items():
        if node.lock_count != pins[node_id]:
            report.fail(
                f"L1: a tree node has {node.lock_count} lock(s), live requests hold {pins[node_id]}"
            )
    counts = report.counts
    counts["l1_total_pages"] = num_total
    counts["l1_free_pages"] = num_free
    counts["l1_cached_pages"] = num_cached
    counts["l1_held_pages"] = len(private)
    counts["l1_locked_pages"] = cache.num_locked_pages
    counts["l1_lock_pins"] = root.lock_count if root is not None else 0


def _count_l2(tiers: HiRadixCache, report: InvariantReport) -> None:
    """L2's pages by state (their accounting is HiRadixCache.check_integrity's)."""
    host = tiers.host
    counts = report.counts
    counts["l2_total_pages"] = host.allocator.num_total_pages
    counts["l2_free_pages"] = host.allocator.num_free_pages
    counts["l2_indexed_pages"] = len(host.indexed_page_ids())
    counts["l2_reserved_pages"] = len(tiers.reserved_host_page_ids())
    counts["l2_reader_pins"] = host.num_reader_pins


def _root(cache: object) -> Any | None:
    """The radix tree's root, or None for a cache without one (NoPrefixCache). An empty
    match is the root; it touches only the root's own access statistics, which eviction
    never reads (the root is never evicted)."""
    if not isinstance(cache, RadixCache):
        return None
    return cache.match_prefix(()).handle


def _path(handle: Any) -> list[Any]:
    """Tree nodes from the top down to `handle` (a RadixCache handle is its node)."""
    path = [handle]
    while path[-1].parent is not None:
        path.append(path[-1].parent)
    path.reverse()
    return path
