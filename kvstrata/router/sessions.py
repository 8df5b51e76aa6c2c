"""`SessionTable`: the agent sessions the router routes (session id -> home rank URL, last
turn, parent) and the session of each Responses API answer it relayed; both bounded, the
least recently routed forgotten first. Lives on the router's event loop only."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from kvstrata.core import SessionRef

MAX_SESSIONS = 65536  # as many as a rank remembers by default (--session-max-sessions)


@dataclass
class SessionHome:
    """Where a session's last turn was routed, when, and its parent (a sub-agent's)."""

    rank_url: str
    last_seen_s: float
    parent_id: str | None = None


class SessionTable:
    """Sessions in the order of their last routed turn (oldest first); a lookup does not
    reorder them, only a routed turn (`place`) does."""

    def __init__(
        self, max_sessions: int = MAX_SESSIONS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_sessions = max_sessions
        self._clock = clock
        self._homes: OrderedDict[str, SessionHome] = OrderedDict()
        self._response_sessions: OrderedDict[str, str] = OrderedDict()  # response id -> session

    def home_of(self, session_id: str) -> SessionHome | None:
        return self._homes.get(session_id)

    def place(self, session: SessionRef, rank_url: str) -> None:
        """A turn of `session` was routed to `rank_url`: that is its home now. A parent
        named once is kept (later turns need not name it again)."""
        known = self._homes.pop(session.session_id, None)
        parent_id = session.parent_id or (known.parent_id if known is not None else None)
        self._homes[session.session_id] = SessionHome(rank_url, self._clock(), parent_id)
        while len(self._homes) > self.max_sessions:
            self._homes.popitem(last=False)

    def forget(self, session_id: str) -> bool:
        """Drop a closed session; whether it was tracked. Its responses keep naming it: a
        follow-up of one starts the session again (`new`)."""
        return self._homes.pop(session_id, None) is not None

    def learn_response(self, response_id: str, session_id: str) -> None:
        self._response_sessions[response_id] = session_id
        self._response_sessions.move_to_end(response_id)
        while len(self._response_sessions) > self.max_sessions:
            self._response_sessions.popitem(last=False)

    def session_of_response(self, response_id: str) -> str | None:
        return self._response_sessions.get(response_id)

    def __len__(self) -> int:
        return len(self._homes)

    def check_integrity(self) -> None:
        """Both maps within the bound; sessions ordered by their last routed turn; no
        session its own parent."""
        assert len(self._homes) <= self.max_sessions, len(self._homes)
        assert len(self._response_sessions) <= self.max_sessions, len(self._response_sessions)
        last_s = float("-inf")
        for session_id, home in self._homes.items():
            assert home.last_seen_s >= last_s, f"{session_id} out of order"
            assert home.parent_id != session_id, f"{session_id} is its own parent"
            last_s = home.last_seen_s
