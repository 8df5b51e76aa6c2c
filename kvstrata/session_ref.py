"""`SessionRef`: which agent session a request is a turn of (kvcache/sessions.py keeps the
sessions), and the rule a session id must meet wherever one arrives (headers, paths, the
PD wire). Part of the request vocabulary `core.py` re-exports."""

from __future__ import annotations

import re
from dataclasses import dataclass

MAX_SESSION_ID_CHARS = 128
_SESSION_ID_CHARS = re.compile(rf"[\x21-\x7e]{{1,{MAX_SESSION_ID_CHARS}}}")  # printable ASCII


def check_session_id(value: str, name: str = "session id") -> str:
    """`value` if it is 1-128 printable ASCII characters (no spaces), else ValueError."""
    if not isinstance(value, str) or _SESSION_ID_CHARS.fullmatch(value) is None:
        raise ValueError(
            f"{name} must be 1-{MAX_SESSION_ID_CHARS} printable ASCII characters without spaces"
        )
    return value


@dataclass(frozen=True)
class SessionRef:
    """Which agent session a request is a turn of: its id, its parent's (a sub-agent), and
    whether this turn is the session's last (after it the session is closed)."""

    session_id: str
    parent_id: str | None = None
    final: bool = False

    def __post_init__(self) -> None:
        check_session_id(self.session_id)
        if self.parent_id is not None:
            check_session_id(self.parent_id, "parent session id")
            if self.parent_id == self.session_id:
                raise ValueError("a session cannot be its own parent")


__all__ = ["MAX_SESSION_ID_CHARS", "SessionRef", "check_session_id"]
