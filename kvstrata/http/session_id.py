"""Which agent session a request is a turn of, read from its headers (kvstrata's spelling
and the peers': Dynamo's, opencode's) or, when the server is told to, the OpenAI `user`
field: a `SessionRef`, or None for a request outside any session."""

from __future__ import annotations

from collections.abc import Mapping

from kvstrata.session_ref import SessionRef, check_session_id

# First present wins; the canonical spelling first (Dynamo: its own header overrides the
# agents' native ones, and so does ours).
SESSION_HEADERS = ("x-session-id", "x-dynamo-session-id", "x-session-affinity")
PARENT_HEADERS = ("x-parent-session-id", "x-dynamo-parent-session-id")
FINAL_HEADERS = ("x-session-final", "x-dynamo-session-final")
_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no", "")


class SessionHeaderError(ValueError):
    """A session header or field with a bad value; the message names it (a 400)."""


def session_of(
    headers: Mapping[str, str], user: str | None = None, *, from_user: bool = False
) -> SessionRef | None:
    """The session `headers` name (a case-insensitive mapping, as aiohttp's and
    starlette's are), else `user` when `from_user`; None when neither does."""
    name, session_id = _first(headers, SESSION_HEADERS)
    if session_id is None and from_user and user:
        name, session_id = "user", user
    if session_id is None:
        return None
    _check(session_id, name)
    parent_name, parent_id = _first(headers, PARENT_HEADERS)
    if parent_id is not None:
        _check(parent_id, parent_name)
        if parent_id == session_id:
            raise SessionHeaderError(f"{parent_name} names the session itself ({name})")
    final_name, final = _first(headers, FINAL_HEADERS)
    if final is not None and final.strip().lower() not in _TRUE + _FALSE:
        raise SessionHeaderError(f"{final_name} must be true or false, got {final[:32]!r}")
    is_final = final is not None and final.strip().lower() in _TRUE
    return SessionRef(session_id, parent_id, is_final)


def _first(headers: Mapping[str, str], names: tuple[str, ...]) -> tuple[str, str | None]:
    for name in names:
        value = headers.get(name)
        if value is not None:
            return name, value
    return names[0], None


def _check(value: str, name: str) -> None:
    try:
        check_session_id(value, name)
    except ValueError as e:
        raise SessionHeaderError(str(e)) from None
