"""The invariants of one engine, checked between two steps. Each owner of pages, locks or
rooms checks itself (`check_integrity()`: the scheduler, the role, the cache tiers); what
needs all of them is checked here, through their contracts only: every L1 page is free,
cached or held (nothing leaked, nothing owned twice), and every request, lock, pin, room
and L3 prefetch belongs to a live request. The rank adds its own tables (server/)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvstrata.kvcache.base import StaleHandle

if TYPE_CHECKING:
    from kvstrata.core import CacheHandle, Request
    from kvstrata.engine.engine import Engine
    from kvstrata.kvcache.base import PrefixCache

# The engine's counts that are zero when nothing is in flight. L3 I/O is not among them: a
# finished background write is only collected by the next engine step, so it may linger.
IN_FLIGHT = (
    "requests",
    "running",
    "waiting",
    "decode_queued",
    "decode_rooms",
    "decode_restoring",
    "zombie_rooms",
    "prefill_rooms",
    "prefill_sending",
    "prefetches",
    "l1_held_pages",
    "l1_locked_pages",
    "l1_lock_pins",
)


@dataclass
class InvariantReport:
    violations: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    in_flight: tuple[str, ...] = IN_FLIGHT  # the counts `idle` needs at zero

    @property
    def ok(self) -> bool:
        return not self.violations

    @property
    def idle(self) -> bool:
        """Nothing in flight: no request, room, prefetch, lock or request-held page."""
        return all(self.counts.get(name, 0) == 0 for name in self.in_flight)

    def fail(self, message: str) -> None:
        self.violations.append(message)

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "idle": self.idle,
            "violations": self.violations,
            "counts": self.counts,
        }


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
    report.counts.update(engine.tiers.invariant_counts())
    session_prefetches = engine.session_prefetch.prefetch_ids()
    for rid in engine.tiers.prefetch_rids():
        if rid not in engine.requests and rid not in session_prefetches:
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
    are the pages of its locked path; the locks held are exactly the live requests' (the
    cache compares its own lock counts: `PrefixCache.check_locks`)."""
    cache = engine.cache
    num_total = engine.allocator.num_total_pages
    num_free = engine.allocator.num_free_pages
    num_cached = cache.num_cached_pages
    handles: list[CacheHandle] = []  # one lock each
    held_cached: set[int] = set()  # cached pages on live requests' paths
    private: Counter[int] = Counter()  # pages a request holds outside the cache
    for req in holders:
        if req.cache_handle is not None:
            handles.append(req.cache_handle)
        path_pages = _path_pages(cache, req, report)
        if req.page_ids[: len(path_pages)] != path_pages:
            report.fail(f"request {req.rid}'s prefix pages are not its locked path's pages")
        held_cached.update(path_pages)
        private.update(req.page_ids[len(path_pages) :])
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
    report.violations += cache.check_locks(handles)
    counts = report.counts
    counts["l1_total_pages"] = num_total
    counts["l1_free_pages"] = num_free
    counts["l1_cached_pages"] = num_cached
    counts["l1_held_pages"] = len(private)
    counts["l1_locked_pages"] = cache.num_locked_pages
    counts["l1_lock_pins"] = cache.num_lock_pins


def _path_pages(cache: PrefixCache, req: Request, report: InvariantReport) -> list[int]:
    """The cached pages `req` holds by its lock (none without one, or with a stale one)."""
    if req.cache_handle is None:
        report.fail(f"request {req.rid} holds {len(req.page_ids)} pages but no lock")
        return []
    try:
        return cache.path_page_ids(req.cache_handle)
    except StaleHandle:
        report.fail(f"request {req.rid} holds a lock on a node no longer in the tree")
        return []
