"""`SessionPrefetcher`: prefetch on resume. A paused session's context moves up the tiers
before its next turn needs it (`POST /sessions/{id}/prefetch`): L3 pages to L2 (the tiers'
own prefetch, under the id `session:<id>`), then L2 pages to L1, so the turn's match finds
them in L1. Owns the prefetches in flight; engine thread only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence

    from kvstrata.engine.kv_manager import RequestKV
    from kvstrata.kvcache.sessions import SessionTable
    from kvstrata.kvcache.tiers import HashSource

PREFETCH_PREFIX = "session:"  # the tiers' prefetch id of a session's prefetch


@dataclass(frozen=True)
class PrefetchStarted:
    """What `POST /sessions/{id}/prefetch` answers: the context's tokens by the tier
    that held them when asked (the L2 ones are in L1 now, room permitting; the L3 ones
    are on their way)."""

    session_id: str
    num_context_tokens: int
    num_l1_tokens: int
    num_l2_tokens: int
    num_l3_pending: bool


@dataclass
class PrefetchStats:
    prefetches: int = 0
    prefetched_tokens_l2: int = 0  # loaded from L2 into L1 ahead of the turn
    prefetch_no_room: int = 0  # L1 had no room for the L2 part: left in L2


class SessionPrefetcher:
    def __init__(self, kv: RequestKV, sessions: SessionTable) -> None:
        self.kv = kv
        self.sessions = sessions
        self.stats = PrefetchStats()
        self._pending: dict[str, list[int]] = {}  # prefetch id -> the context's tokens

    def start(self, session_id: str) -> PrefetchStarted | None:
        """None: the rank does not know the session."""
        token_ids = self.sessions.context_of(session_id)
        if token_ids is None:
            return None
        self.stats.prefetches += 1
        hashes = self._hashes(token_ids)
        match = self.kv.tiers.match(token_ids, hashes)
        num_l2_tokens = self._load_l2(token_ids, hashes)
        prefetch_id = PREFETCH_PREFIX + session_id
        self.kv.tiers.start_prefetch(prefetch_id, token_ids, hashes)
        pending = prefetch_id in self.kv.tiers.prefetch_rids()
        if pending:
            self._pending[prefetch_id] = token_ids
        return PrefetchStarted(
            session_id, len(token_ids), match.l1_len, num_l2_tokens, num_l3_pending=pending
        )

    def poll(self) -> None:
        """Once a step: an L3 prefetch that landed in L2 goes on to L1."""
        for prefetch_id, token_ids in list(self._pending.items()):
            if self.kv.tiers.pending_read(prefetch_id) is not None:
                continue
            self.kv.tiers.end_prefetch(prefetch_id)
            del self._pending[prefetch_id]
            self._load_l2(token_ids, self._hashes(token_ids))

    def metrics(self) -> dict[str, float]:
        """The session table's counters and the prefetches', for /metrics."""
        prefetches = {f"session_{k}": v for k, v in vars(self.stats).items()}
        return self.sessions.metrics() | prefetches

    def prefetch_ids(self) -> set[str]:
        return set(self._pending)

    def _load_l2(self, token_ids: Sequence[int], hashes: HashSource) -> int:
        """The L2 part of the context's match into L1, if L1 can make room (evicting by
        its own order, never a locked page). Returns the tokens loaded."""
        tiers = self.kv.tiers
        match = tiers.match(token_ids, hashes)
        num_pages = len(match.host_page_ids)
        if not num_pages:
            return 0
        tiers.lock(match)
        if num_pages > self.kv.num_available_pages:
            tiers.unlock(match)
            self.stats.prefetch_no_room += 1
            return 0
        self.kv.make_free(num_pages)
        restored = tiers.restore(token_ids[: match.prefix_len], match, hashes)
        tiers.l1.unlock(restored.handle)
        retention = self.sessions.paused_retention
        tiers.retain(token_ids[: match.prefix_len], retention, hashes)
        num_tokens = num_pages * self.kv.page_size
        self.stats.prefetched_tokens_l2 += num_tokens
        return num_tokens

    def _hashes(self, token_ids: Sequence[int]) -> HashSource:
        return self.kv.hash_chain(lambda: token_ids, [])
