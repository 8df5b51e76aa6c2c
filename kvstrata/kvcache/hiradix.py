"""HiRadixCache: L1 radix tree + L2 host pages + L3 storage, one prefix index per tier.

L1 is the radix tree over token keys (radix.py). L2 and L3 are keyed by the chained page
hash, which names a whole prefix, so a page found there is valid for exactly that prefix.
This object owns the write policy, L2 load-back and how L2 includes L1: non-inclusive by
default (L2's copies of pages L1 holds give way first, and L1 writes such a page again
when it evicts it), so under pressure the two tiers hold up to L1 + L2 distinct pages. It
reports L2 page events to its cache digest; its L1PageIndex (page_index.py) names the L1
pages by hash and reports theirs; its L3Jobs (l3_jobs.py) runs L3 prefetches and
background writes. Only the engine thread calls it."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from kvstrata.core import PrefixMatch, TierMatch
from kvstrata.kvcache.copier import Copier
from kvstrata.kvcache.digest import TIER_L2, CacheDigest
from kvstrata.kvcache.hicache_policy import PrefetchPolicy, WritePolicy
from kvstrata.kvcache.host import HostCache
from kvstrata.kvcache.l3_io import L3Job, L3Port
from kvstrata.kvcache.l3_jobs import L3Jobs, Prefetch
from kvstrata.kvcache.page_index import L1PageIndex
from kvstrata.kvcache.pages import OutOfPages
from kvstrata.kvcache.radix import RadixCache
from kvstrata.kvcache.retention import NO_RETENTION, HeldHint, Retention
from kvstrata.kvcache.tiers import HashSource, PendingRead


@dataclass
class HiCacheStats:
    hit_tokens_l1: int = 0
    hit_tokens_l2: int = 0
    hit_tokens_l3: int = 0
    evicted_pages_l1: int = 0
    demoted_pages_l1: int = 0  # of which retained (a paused session's), held by L2 after
    # Retained pages dropped: L2 held nothing worth less (lower priority, or older).
    undemoted_pages_l1: int = 0
    backup_failures: int = 0  # L2 had no room: the page stays in L1 only
    # Non-inclusive L2: pages whose L2 copy gave way while L1 held them, written to L2
    # again when L1 evicted them.
    recopied_pages_l1: int = 0


class HiRadixCache:
    def __init__(
        self,
        l1: RadixCache,
        host: HostCache,
        copier: Copier,
        write_policy: WritePolicy,
        l3: L3Port | None,
        prefetch_policy: PrefetchPolicy,
        inclusive: bool = False,
    ) -> None:
        self.l1 = l1
        self.host = host
        self.copier = copier
        self.write_policy = write_policy
        self.l3 = l3
        self.inclusive = inclusive
        self.page_size = l1.page_size
        self.stats = HiCacheStats()
        self.digest = CacheDigest(self.page_size)
        self.l1_index = L1PageIndex(l1, self.digest, on_evict=self._on_l1_evict)
        self._num_hits: dict[bytes, int] = {}  # for write_through_selective
        self._num_match_pins = 0  # L2 reader pins held by locked matches
        # Non-inclusive: L1 pages whose L2 copy gave way while L1 held them (L1 owes L2
        # a copy when it evicts them).
        self._copies_owed: dict[bytes, None] = {}
        self._l3_jobs = L3Jobs(l3, host, self.digest, prefetch_policy, self.page_size)
        host.evict_listener = self._on_l2_evict

    # -- matching and restore ------------------------------------------------------

    def match(self, token_ids: Sequence[int], hashes: HashSource) -> TierMatch:
        l1_match = self.l1.match_prefix(token_ids)
        num_full_pages = len(token_ids) // self.page_size
        if num_full_pages == l1_match.num_pages:
            return TierMatch(l1_match)
        page_hashes = hashes(num_full_pages)[l1_match.num_pages :]
        host_page_ids = self.host.match(page_hashes)
        num_l3_pages = sum(self.host.from_l3(h) for h in page_hashes[: len(host_page_ids)])
        num_l2_pages = len(host_page_ids) - num_l3_pages
        return TierMatch(
            l1_match,
            host_page_ids,
            page_hashes[: len(host_page_ids)],
            l2_len=num_l2_pages * self.page_size,
            l3_len=num_l3_pages * self.page_size,
        )

    def lock(self, match: TierMatch) -> None:
        self.l1.lock(match.l1.handle)
        self.host.add_reader(match.host_page_hashes)
        self._num_match_pins += len(match.host_page_hashes)

    def unlock(self, match: TierMatch) -> None:
        self.l1.unlock(match.l1.handle)
        self.host.remove_reader(match.host_page_hashes)
        self._num_match_pins -= len(match.host_page_hashes)

    def fence_loads(self) -> None:
        self.copier.fence_loads()

    def restore(
        self, token_ids: Sequence[int], match: TierMatch, hashes: HashSource
    ) -> PrefixMatch:
        self.stats.hit_tokens_l1 += match.l1_len
        self.stats.hit_tokens_l2 += match.l2_len
        self.stats.hit_tokens_l3 += match.l3_len
        self._count_hits(match.l1.page_ids)
        if not match.host_page_ids:
            return match.l1
        l1_page_ids = self.l1.allocator.alloc(len(match.host_page_ids))
        self.copier.load_back(match.host_page_ids, l1_page_ids)
        self.host.remove_reader(match.host_page_hashes)
        self._num_match_pins -= len(match.host_page_hashes)
        num_pages = match.l1.num_pages + len(l1_page_ids)
        for page_hash in hashes(num_pages)[match.l1.num_pages :]:
            self.host.clear_from_l3(page_hash)  # from now on it is an ordinary L2 page
        restored_len = num_pages * self.page_size
        self.insert(token_ids[:restored_len], match.l1.page_ids + l1_page_ids, hashes)
        restored = self.l1.match_prefix(token_ids[:restored_len])
        assert restored.prefix_len == restored_len
        self.l1.lock(restored.handle)
        self.l1.unlock(match.l1.handle)
        return restored

    # -- insertion and the write policy -----------------------------------------------

    def insert(self, token_ids: Sequence[int], page_ids: Sequence[int], hashes: HashSource) -> None:
        new_page_ids, new_hashes = self.l1_index.insert(token_ids, page_ids, hashes)
        if new_page_ids and self.write_policy.on_insert:
            self._backup(new_page_ids, new_hashes)
        self._shadow(new_hashes)  # L1 now holds them (restored ones included)

    def _shadow(self, page_hashes: list[bytes]) -> None:
        if not self.inclusive:
            self.host.shadow(page_hashes)

    def _on_l2_evict(self, page_hashes: list[bytes]) -> None:
        self.digest.remove(TIER_L2, page_hashes)
        if not self.inclusive:
            self._copies_owed.update((h, None) for h in page_hashes if h in self.l1_index)

    def retain(self, token_ids: Sequence[int], retention: Retention, hashes: HashSource) -> None:
        self.l1.retain(token_ids, retention)
        self.host.retain(hashes(len(token_ids) // self.page_size), retention)

    def reset_retention(
        self, token_ids: Sequence[int], keep_len: int, retention: Retention, hashes: HashSource
    ) -> None:
        self.l1.reset_retention(token_ids, keep_len, retention)
        chain = hashes(len(token_ids) // self.page_size)
        self.host.reset_retention(chain[-(-keep_len // self.page_size) :], retention)

    def _count_hits(self, l1_page_ids: list[int]) -> None:
        min_hits = self.write_policy.min_hits
        if not min_hits:
            return
        due_pages, due_hashes = [], []
        for page_id in l1_page_ids:
            page_hash = self.l1_index.hash_of(page_id)
            self._num_hits[page_hash] = num_hits = self._num_hits.get(page_hash, 0) + 1
            if num_hits >= min_hits:
                due_pages.append(page_id)
                due_hashes.append(page_hash)
        self._backup(due_pages, due_hashes)
        self._shadow(due_hashes)

    def _on_l1_evict(self, l1_page_ids: list[int], hashes: list[bytes], hint: HeldHint) -> None:
        """Before the digest hears of the eviction: a backup keeps the pages servable.
        Pages still retained (a paused session's) are demoted to L2 whatever the write
        policy, and carry their hint there; so are pages whose L2 copy gave way while L1
        held them (non-inclusive), displacing only L2 pages worth less."""
        self.stats.evicted_pages_l1 += len(l1_page_ids)
        self.host.unshadow(hashes)  # L2's copies are the only ones now
        for page_hash in hashes:
            self._num_hits.pop(page_hash, None)
        owed = [i for i, h in enumerate(hashes) if h in self._copies_owed]
        for i in owed:
            del self._copies_owed[hashes[i]]
        owed = [i for i in owed if hashes[i] not in self.host]  # an L3 read may index it
        retained = hint.effective_priority(self.l1.now_s()) > 0
        if self.write_policy.on_evict or retained:
            num_held = self._backup(l1_page_ids, hashes, hint)
            if retained:
                self.stats.demoted_pages_l1 += num_held
                self.stats.undemoted_pages_l1 += len(l1_page_ids) - num_held
        elif owed:
            self._backup([l1_page_ids[i] for i in owed], [hashes[i] for i in owed], hint)
        self.stats.recopied_pages_l1 += sum(hashes[i] in self.host for i in owed)
        self.copier.fence_l1()  # the pages are freed next: no later work before their copy

    def _backup(
        self, l1_page_ids: list[int], page_hashes: list[bytes], hint: HeldHint | None = None
    ) -> int:
        """Copy the pages L2 lacks to L2, then (with L3) write them through to storage;
        returns how many of the pages L2 holds afterwards. `hint`: the pages come from
        L1's eviction (a chain's consecutive pages, head first) and keep the hint they
        held there; they displace only L2 pages worth less, the head first. Without it
        L1 keeps the pages: a non-inclusive L2 takes their copies into free room only
        (a copy is worth nothing while L1 holds the page) and L1 owes it the rest."""
        if hint is not None and hint.retention != NO_RETENTION:
            self.host.retain(page_hashes, hint.retention)  # the copies L2 already has
        todo = [(p, h) for p, h in zip(l1_page_ids, page_hashes) if h not in self.host]
        num_held = len(l1_page_ids) - len(todo)
        if not todo:
            return num_held
        if hint is not None:
            host_page_ids = self.host.alloc_displacing(len(todo), hint)
        elif not self.inclusive:
            free = self.host.allocator
            host_page_ids = free.alloc(min(len(todo), free.num_free_pages))
            self._copies_owed.update((h, None) for _, h in todo[len(host_page_ids) :])
        else:
            try:
                host_page_ids = self.host.alloc(len(todo))
            except OutOfPages:
                self.stats.backup_failures += len(todo)
                return num_held
        todo = todo[: len(host_page_ids)]
        if not todo:
            return num_held
        self.copier.backup([p for p, _ in todo], host_page_ids)
        todo_hashes = [h for _, h in todo]
        for page_hash in todo_hashes:
            self._copies_owed.pop(page_hash, None)
        self.host.add_chain(todo_hashes, host_page_ids, hint=hint)
        self.digest.add_known(TIER_L2, todo_hashes)
        self._l3_jobs.write(todo_hashes, host_page_ids, self.copier.host_fence())
        return num_held + len(todo)

    # -- L3 prefetch ---------------------------------------------------------------

    def start_prefetch(self, rid: str, token_ids: Sequence[int], hashes: HashSource) -> None:
        if self.l3 is None or rid in self._l3_jobs.prefetches:
            return
        num_full_pages = len(token_ids) // self.page_size
        page_hashes = hashes(num_full_pages)
        num_local = 0  # leading pages already in L1 or L2 need no prefetch
        for page_hash in page_hashes:
            if page_hash not in self.l1_index and page_hash not in self.host:
                break
            num_local += 1
        self.copier.host_fence()()  # its host pages may be ones a backup still writes
        self._l3_jobs.start_prefetch(rid, page_hashes, num_local)

    def prefetch_ready(self, rid: str) -> bool:
        return self._l3_jobs.prefetch_ready(rid)

    def pending_read(self, rid: str) -> PendingRead | None:
        return self._l3_jobs.pending_read(rid)

    def load_into(self, page_hashes: Sequence[bytes], l1_page_ids: Sequence[int]) -> int:
        host_page_ids = self.host.match(list(page_hashes))
        num_pages = len(host_page_ids)
        self.copier.load_back(host_page_ids, list(l1_page_ids[:num_pages]))
        for page_hash in page_hashes[:num_pages]:
            self.host.clear_from_l3(page_hash)  # from now on it is an ordinary L2 page
        self.stats.hit_tokens_l3 += num_pages * self.page_size
        return num_pages

    def end_prefetch(self, rid: str) -> None:
        self._l3_jobs.end_prefetch(rid)

    def poll(self) -> None:
        self._l3_jobs.poll()

    # -- metrics and flush -------------------------------------------------------------

    def metrics(self) -> dict[str, float]:
        """Counters since start-up, flat, for /metrics (names carry units)."""
        stats = vars(self.stats) | vars(self._l3_jobs.stats)
        out: dict[str, float] = {f"hicache_{k}": v for k, v in stats.items()}
        for name, copy in (
            ("backup", self.copier.backup_stats),
            ("load_back", self.copier.load_back_stats),
        ):
            out[f"hicache_{name}_pages"] = copy.num_pages
            out[f"hicache_{name}_bytes"] = copy.num_bytes
            out[f"hicache_{name}_seconds"] = copy.seconds
        out["hicache_l2_cached_pages"] = self.host.num_cached_pages
        out["hicache_l2_total_pages"] = self.host.allocator.num_total_pages
        out["hicache_evicted_pages_l2"] = self.host.num_evicted_pages
        out["hicache_l2_retained_pages"] = self.host.num_hinted_pages
        out["hicache_l2_l1_copy_pages"] = self.host.num_shadow_pages
        if self.l3 is not None:
            storage = self.l3.backend.stats()
            for key, value in vars(storage).items():
                out[f"hicache_l3_{key}"] = value
        return out

    def wait_io(self) -> None:
        """Block until every L3 read and write has finished and is collected."""
        self._l3_jobs.wait()

    def flush(self) -> None:
        self.copier.host_fence()()
        self._l3_jobs.flush()
        self.l1_index.reset()
        self._num_hits.clear()
        self._copies_owed.clear()
        self.host.reset()
        self.digest.clear()

    def close(self) -> None:
        self.wait_io()
        if self.l3 is not None:
            self.l3.shutdown()
            self.l3.backend.close()

    def clear_l3(self) -> int | None:
        if self.l3 is None:
            return None
        self.wait_io()
        return self.l3.clear()

    # -- read-only views for the invariants (see TieredCache) ----------------------------

    def prefetch_rids(self) -> list[str]:
        return list(self._l3_jobs.prefetches)

    def invariant_counts(self) -> dict[str, int]:
        """L2's pages by state (their accounting is `_check_l2`'s) and the prefetches."""
        return {
            "l2_total_pages": self.host.allocator.num_total_pages,
            "l2_free_pages": self.host.allocator.num_free_pages,
            "l2_indexed_pages": self.host.num_cached_pages,
            "l2_reserved_pages": len(self.reserved_host_page_ids()),
            "l2_reader_pins": self.host.num_reader_pins,
            "prefetches": len(self._l3_jobs.prefetches),
        }

    def reserved_host_page_ids(self) -> list[int]:
        """L2 pages allocated to prefetch reads not collected yet (allocated, unindexed)."""
        return self._l3_jobs.reserved_host_page_ids()

    @property
    def num_l3_write_pages(self) -> int:
        """Pages of L3 writes not collected yet; each holds one reader pin on its L2 page."""
        return self._l3_jobs.num_write_pages

    # The L3 job tables under the names the integrity tests corrupt them by (their owner
    # is `_l3_jobs`; nothing here changes them).

    @property
    def _prefetches(self) -> dict[str, Prefetch]:
        return self._l3_jobs.prefetches

    @property
    def _reads(self) -> list[L3Job]:
        return self._l3_jobs.reads

    @property
    def _read_parent(self) -> dict[int, bytes | None]:
        return self._l3_jobs.read_parent

    # -- integrity (see TieredCache.check_integrity) ------------------------------------

    def check_integrity(self) -> list[str]:
        violations = self.l1.check_integrity() + self.l1_index.check_integrity()
        violations += self.host.check_integrity() + self.digest.check_integrity()
        return violations + self._check_l2() + self._l3_jobs.check_integrity()

    def _check_l2(self) -> list[str]:
        """Every L2 page free, indexed or reserved by a prefetch read, once; reader pins
        exactly those of L3 writes in flight and of locked matches."""
        violations = []
        num_total = self.host.allocator.num_total_pages
        num_free = self.host.allocator.num_free_pages
        indexed, reserved = self.host.indexed_page_ids(), self.reserved_host_page_ids()
        if num_free + len(indexed) + len(reserved) != num_total:
            violations.append(
                f"hicache: L2 {num_free} free + {len(indexed)} indexed + {len(reserved)} "
                f"reserved by prefetch != {num_total} pages"
            )
        if len(set(indexed + reserved)) != len(indexed) + len(reserved):
            twice = sorted(p for p, n in Counter(indexed + reserved).items() if n > 1)
            violations.append(f"hicache: L2 pages indexed or reserved twice: {twice[:10]}")
        num_pins, num_writing = self.host.num_reader_pins, self.num_l3_write_pages
        if num_pins != num_writing + self._num_match_pins:
            violations.append(
                f"hicache: {num_pins} L2 reader pins, but {num_writing} pages are being "
                f"written and {self._num_match_pins} pinned by locked matches"
            )
        if any(page_hash not in self.l1_index for page_hash in self._num_hits):
            violations.append("hicache: hit counts kept for pages L1 no longer caches")
        # (An owed page may be in L2 again: an L3 prefetch can index its copy, and then
        # L1's eviction finds it there and copies nothing.)
        if any(h not in self.l1_index for h in self._copies_owed):
            violations.append("hicache: L2 copies owed for pages L1 no longer caches")
        return violations
