"""`SessionTable`: the agent sessions a rank serves and the state of each (active while a
turn runs, paused between turns, closed after its last), which sets the retention its
pages hold in every tier: a paused session's are kept (demoted to L2/L3, not dropped), a
closed session's own pages fall back to recency, a closed sub-agent's go first."""

from __future__ import annotations

import enum
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvstrata.core import SessionRef
from kvstrata.kvcache.retention import EVICT_FIRST, NO_RETENTION, Retention

if TYPE_CHECKING:
    from kvstrata.config.sessions import SessionOptions
    from kvstrata.kvcache.tiers import HashSource, TieredCache


class SessionState(enum.Enum):
    ACTIVE = "active"  # a turn of it is running
    PAUSED = "paused"  # between turns (a tool call, a human reading, its sub-agents)
    CLOSED = "closed"  # its last turn ended, or a client closed it


@dataclass
class _Session:
    session_id: str
    parent_id: str | None
    state: SessionState = SessionState.ACTIVE
    num_turns: int = 0
    # Its context as the cache holds it: the last turn's full pages (token ids packed as
    # uint32, 4 bytes each; their chain hashes).
    token_ids: array[int] = field(default_factory=lambda: array("I"))
    page_hashes: list[bytes] = field(default_factory=list)


@dataclass(frozen=True)
class SessionInfo:
    """What `GET /sessions/{id}` answers."""

    session_id: str
    parent_id: str | None
    state: str
    num_turns: int
    num_cached_tokens: int  # the context its pages hold (full pages of its last turn)


@dataclass
class SessionStats:
    turns_started: int = 0
    sessions_closed: int = 0
    sessions_forgotten: int = 0  # dropped from the table (max_sessions), hints left to decay


class SessionTable:
    """Engine thread only. Closed sessions stay listed (as closed) until forgotten, so a
    late turn of one is still told apart from a new session; a turn of a closed session
    opens it again."""

    def __init__(self, tiers: TieredCache, options: SessionOptions) -> None:
        self.tiers = tiers
        self.options = options
        self.paused_retention = (
            Retention(options.paused_priority, options.paused_retention_s)
            if options.paused_priority
            else NO_RETENTION
        )
        self.queued_retention = (
            Retention(options.queued_priority, options.paused_retention_s)
            if options.queued_priority
            else NO_RETENTION
        )
        self._sessions: OrderedDict[str, _Session] = OrderedDict()  # least recent first
        self._active: dict[str, _Session] = {}  # those in state ACTIVE (a turn queued or running)
        self._num_tokens = 0  # the contexts' tokens held, summed (bounded by the options)
        self.stats = SessionStats()

    def turn_started(self, session: SessionRef | None) -> None:
        """A turn of `session` (None: a request outside any session) entered the engine."""
        if session is None:
            return
        entry = self._sessions.get(session.session_id)
        if entry is None:
            entry = self._sessions[session.session_id] = _Session(
                session.session_id, session.parent_id
            )
            self._forget_oldest()
        self._sessions.move_to_end(session.session_id)
        if session.parent_id is not None:
            entry.parent_id = session.parent_id
        self._set_state(entry, SessionState.ACTIVE)
        entry.num_turns += 1
        self.stats.turns_started += 1
        if self.queued_retention is not NO_RETENTION and entry.token_ids:
            self.tiers.retain(entry.token_ids, self.queued_retention, _chain_of(entry))

    def pages_released(
        self, session: SessionRef, token_ids: Sequence[int], hashes: HashSource
    ) -> None:
        """A turn of `session` gave its full pages (`token_ids`) to the cache: they hold
        the paused retention from now on (while the turn runs they are locked anyway)."""
        entry = self._sessions.get(session.session_id)
        if entry is None:
            return  # forgotten (max_sessions) while its turn ran
        # A shorter view of the context it already has (a preempted turn's) changes nothing.
        packed = array("I", token_ids)
        if not _is_prefix(packed, entry.token_ids):
            self._num_tokens += len(packed) - len(entry.token_ids)
            entry.token_ids = packed
            entry.page_hashes = hashes(len(token_ids) // self._page_size)
            self._forget_oldest()
        if self.paused_retention is not NO_RETENTION:
            self.tiers.retain(token_ids, self.paused_retention, hashes)

    def turn_ended(self, session: SessionRef | None) -> None:
        """A turn left the engine (finished or aborted); the final one closes it."""
        if session is None:
            return
        entry = self._sessions.get(session.session_id)
        if entry is None:
            return
        if session.final:
            self.close(session.session_id)
        elif entry.state is SessionState.ACTIVE:
            self._set_state(entry, SessionState.PAUSED)
            if self.queued_retention is not NO_RETENTION:
                self._lower(entry, self.paused_retention, self._active.values())

    def close(self, session_id: str) -> bool:
        """Its own pages (past the longest prefix a live session shares with it) fall back
        to recency, or go first for a sub-agent. False: no such session."""
        entry = self._sessions.get(session_id)
        if entry is None:
            return False
        if entry.state is not SessionState.CLOSED:
            self._set_state(entry, SessionState.CLOSED)
            self.stats.sessions_closed += 1
            self._release(entry)
        return True

    def info(self, session_id: str) -> SessionInfo | None:
        entry = self._sessions.get(session_id)
        if entry is None:
            return None
        return SessionInfo(
            entry.session_id,
            entry.parent_id,
            entry.state.value,
            entry.num_turns,
            len(entry.token_ids),
        )

    def context_of(self, session_id: str) -> list[int] | None:
        """The tokens of the session's context the cache may hold (for a prefetch)."""
        entry = self._sessions.get(session_id)
        return entry.token_ids.tolist() if entry is not None else None

    def metrics(self) -> dict[str, float]:
        counts = {state: 0 for state in SessionState}
        for entry in self._sessions.values():
            counts[entry.state] += 1
        out: dict[str, float] = {f"sessions_{s.value}": n for s, n in counts.items()}
        return out | {f"session_{k}": v for k, v in vars(self.stats).items()}

    # -- internals ----------------------------------------------------------------

    @property
    def _page_size(self) -> int:
        return self.tiers.l1.page_size

    def _set_state(self, entry: _Session, state: SessionState) -> None:
        entry.state = state
        if state is SessionState.ACTIVE:
            self._active[entry.session_id] = entry
        else:
            self._active.pop(entry.session_id, None)

    def _release(self, entry: _Session) -> None:
        retention = EVICT_FIRST if entry.parent_id is not None else NO_RETENTION
        live = (e for e in self._sessions.values() if e.state is not SessionState.CLOSED)
        self._lower(entry, retention, live)

    def _lower(self, entry: _Session, retention: Retention, others: Iterable[_Session]) -> None:
        """`entry`'s context takes `retention`, past the longest prefix it shares with
        one of `others` (whose hint that prefix keeps)."""
        if not entry.token_ids:
            return
        keep_pages = max(
            (_common_pages(entry.page_hashes, o.page_hashes) for o in others if o is not entry),
            default=0,
        )
        keep_len = keep_pages * self._page_size
        self.tiers.reset_retention(entry.token_ids, keep_len, retention, _chain_of(entry))

    def _forget_oldest(self) -> None:
        """Keep within max_sessions and max_session_tokens (the newest always stays)."""
        options = self.options
        while len(self._sessions) > 1 and (
            len(self._sessions) > options.max_sessions
            or self._num_tokens > options.max_session_tokens
        ):
            _, entry = self._sessions.popitem(last=False)
            self._active.pop(entry.session_id, None)
            self._num_tokens -= len(entry.token_ids)
            self.stats.sessions_forgotten += 1


def _chain_of(entry: _Session) -> HashSource:
    chain = entry.page_hashes

    def hashes(num_pages: int) -> list[bytes]:
        return chain[:num_pages]

    return hashes


def _is_prefix(short: array[int], long: array[int]) -> bool:
    return len(short) <= len(long) and long[: len(short)] == short


def _common_pages(a: list[bytes], b: list[bytes]) -> int:
    """Full pages two contexts share: a binary search over their chain hashes (a page's
    hash covers every token before it, so equal hashes at i mean equal pages up to i).
    O(log pages) comparisons of 32-byte hashes, whatever the contexts' lengths: this
    runs against every active session at each turn's end."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        mid = (low + high + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            low = mid
        else:
            high = mid - 1
    return low
