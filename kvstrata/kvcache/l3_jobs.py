"""The L3 jobs a HiRadixCache has in flight (`L3Jobs`): per-request prefetch reads, with
the prefetch policy's deadlines, and write-throughs, each pinning its L2 pages. The engine
thread collects finished jobs into L2 (`poll`); l3_io.py's workers only move bytes."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from kvstrata.kvcache.digest import TIER_L2, CacheDigest
from kvstrata.kvcache.hicache_policy import PrefetchPolicy
from kvstrata.kvcache.host import HostCache
from kvstrata.kvcache.l3_io import L3Job, L3Port
from kvstrata.kvcache.tiers import PendingRead


@dataclass
class L3Stats:
    prefetch_pages: int = 0
    prefetch_seconds: float = 0.0
    prefetch_timeouts: int = 0
    l3_written_pages: int = 0
    l3_write_seconds: float = 0.0


@dataclass
class Prefetch:
    job: L3Job
    deadline_s: float | None  # None: no deadline (wait_complete)
    first_page: int  # index in the request's page chain of the job's first page


class L3Jobs:
    """The job tables are this object's: others read them, only its methods change them.
    A read's L2 pages are allocated but unindexed (reserved) until it is collected; a
    write holds one reader pin on each of its L2 pages until it is collected."""

    def __init__(
        self,
        l3: L3Port | None,
        host: HostCache,
        digest: CacheDigest,
        policy: PrefetchPolicy,
        page_size: int,
    ) -> None:
        self.l3 = l3
        self.host = host
        self.digest = digest
        self.policy = policy
        self.page_size = page_size
        self.stats = L3Stats()
        self.prefetches: dict[str, Prefetch] = {}  # by request id, until admitted
        self.reads: list[L3Job] = []  # every unfinished prefetch read
        self.writes: list[L3Job] = []
        self.read_parent: dict[int, bytes | None] = {}  # by id(job): hash before its pages

    # -- prefetch reads ------------------------------------------------------------------

    def start_prefetch(self, rid: str, page_hashes: list[bytes], num_local: int) -> None:
        """Read request `rid`'s chain `page_hashes` past its first `num_local` pages (in
        L1 or L2 already) from L3 into L2, if enough is wanted and L2 has room. The caller
        has checked that there is an L3 and no prefetch of `rid` yet."""
        assert self.l3 is not None
        wanted = page_hashes[num_local:]
        policy = self.policy
        if len(wanted) * self.page_size < max(policy.threshold_tokens, 1):
            return
        # Admission: a prefetch takes only L2 pages nobody else needs right now.
        num_pages = min(len(wanted), self.host.num_available_pages // 2)
        if num_pages == 0:
            return
        host_page_ids = self.host.alloc(num_pages)
        job = self.l3.read(wanted[:num_pages], host_page_ids)
        self.reads.append(job)
        self.read_parent[id(job)] = page_hashes[num_local - 1] if num_local else None
        deadline_s = None
        if policy.name == "timeout":
            budget_s = policy.timeout_base_s + policy.timeout_per_1k_tokens_s * (
                num_pages * self.page_size / 1000
            )
            deadline_s = job.start_s + budget_s
        self.prefetches[rid] = Prefetch(job, deadline_s, num_local)

    def prefetch_ready(self, rid: str) -> bool:
        prefetch = self.prefetches.get(rid)
        if prefetch is None:
            return True
        if prefetch.job.future.done():
            self.poll()
            return True
        if self.policy.name == "best_effort":
            return True
        if prefetch.deadline_s is not None and time.monotonic() >= prefetch.deadline_s:
            self.stats.prefetch_timeouts += 1
            return True
        return False

    def pending_read(self, rid: str) -> PendingRead | None:
        prefetch = self.prefetches.get(rid)
        if prefetch is None or prefetch.job.collected:
            return None
        job = prefetch.job
        num_present = job.present.result() if job.present.done() else None
        return PendingRead(
            prefetch.first_page, job.page_hashes, num_present, prefetch.deadline_s, job
        )

    def end_prefetch(self, rid: str) -> None:
        # An unfinished read still lands in L2 when it completes (poll): valid pages.
        self.prefetches.pop(rid, None)

    # -- write-throughs ------------------------------------------------------------------

    def write(
        self, page_hashes: list[bytes], host_page_ids: list[int], ready: Callable[[], None]
    ) -> None:
        """Write L2 pages through to L3 in the background (without L3: nothing), once
        `ready` (the copier's host fence: their backup is done) has returned."""
        if self.l3 is None:
            return
        self.host.add_reader(page_hashes)
        self.writes.append(self.l3.write(page_hashes, host_page_ids, ready))

    @property
    def num_write_pages(self) -> int:
        """Pages of L3 writes not collected yet; each holds one reader pin on its L2 page."""
        return sum(len(job.page_hashes) for job in self.writes)

    # -- collection ----------------------------------------------------------------------

    def poll(self) -> None:
        self.reads = [job for job in self.reads if not self._collect_read(job)]
        self.writes = [job for job in self.writes if not self._collect_write(job)]

    def wait(self) -> None:
        """Block until every L3 read and write has finished and is collected."""
        for job in self.reads + self.writes:
            job.future.exception()  # waits; errors were already turned into misses
        self.poll()

    def flush(self) -> None:
        """Wait for every job, then forget every prefetch (what they read stays in L2)."""
        self.wait()
        self.prefetches.clear()

    def _collect_read(self, job: L3Job) -> bool:
        if not job.future.done():
            return False
        num_ok = job.future.result()
        job.collected = True
        self.host.add_chain(job.page_hashes[:num_ok], job.host_page_ids[:num_ok], from_l3=True)
        self.digest.add_chain(TIER_L2, job.page_hashes[:num_ok], self.read_parent.pop(id(job)))
        self.host.allocator.free(job.host_page_ids[num_ok:])
        self.stats.prefetch_pages += num_ok
        self.stats.prefetch_seconds += time.monotonic() - job.start_s
        return True

    def _collect_write(self, job: L3Job) -> bool:
        if not job.future.done():
            return False
        self.stats.l3_written_pages += job.future.result()
        self.stats.l3_write_seconds += time.monotonic() - job.start_s
        self.host.remove_reader(job.page_hashes)
        return True

    # -- integrity (see HiRadixCache.check_integrity) ------------------------------------

    def reserved_host_page_ids(self) -> list[int]:
        """L2 pages allocated to prefetch reads not collected yet (allocated, unindexed)."""
        return [page_id for job in self.reads for page_id in job.host_page_ids]

    def check_integrity(self) -> list[str]:
        """The job tables: pending reads uncollected, each with its parent hash, their
        reserved pages allocated; writes of indexed pages; each prefetch's read pending
        or collected. (That a prefetch's request is alive is engine/invariants.py's.)"""
        violations = []
        if self.l3 is None and (self.reads or self.writes or self.prefetches):
            violations.append("hicache: L3 jobs or prefetches but no L3")
        pending = {id(job) for job in self.reads}
        if any(job.collected for job in self.reads):
            violations.append("hicache: a collected L3 read is still pending")
        if self.read_parent.keys() != pending:
            violations.append(
                f"hicache: {len(self.read_parent)} read parents for {len(pending)} pending reads"
            )
        if any(len(job.page_hashes) != len(job.host_page_ids) for job in self.reads + self.writes):
            violations.append("hicache: an L3 job's page hashes and L2 pages differ in number")
        num_total = self.host.allocator.num_total_pages
        reserved = self.reserved_host_page_ids()
        free = self.host.allocator.free_among(p for p in reserved if 0 <= p < num_total)
        if free:
            violations.append(f"hicache: L2 pages reserved by a read but free: {free[:10]}")
        if any(h not in self.host for job in self.writes for h in job.page_hashes):
            violations.append("hicache: an L3 write of a page no longer in L2")
        for rid, prefetch in self.prefetches.items():
            if not prefetch.job.collected and id(prefetch.job) not in pending:
                violations.append(f"hicache: prefetch of {rid} waits for a read that is gone")
        return violations
