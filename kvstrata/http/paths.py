"""Canonical request paths: `path_problem` says why a path could mean one thing here and
another at the next hop (dot or empty segments, backslashes, control characters, an
encoded `.`, `/`, `\\` or `%`). The router forwards, and keys, only paths without one."""

from __future__ import annotations

import re
from urllib.parse import unquote

# %2e '.', %2f '/', %5c '\', %25 '%' (a second round of decoding), %00 NUL: a client
# never needs to encode these in a path, and each lets a path normalise differently
# once decoded (by us, by httpx, or by the rank).
_ENCODED_SPECIAL = re.compile(rb"%(?:2e|2f|5c|25|00)", re.IGNORECASE)
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def path_problem(raw_path: bytes) -> str | None:
    """Why `raw_path` (as received, still percent-encoded) is not canonical; None if it
    is: it starts with `/`, and decoded it has no `.` or `..` segment, no empty segment
    but a trailing one, no backslash and no control character."""
    if _ENCODED_SPECIAL.search(raw_path):
        return "an encoded '.', '/', '\\' or '%'"
    path = unquote(raw_path.decode("latin-1"))
    if not path.startswith("/"):
        return "no leading '/'"
    if "\\" in path:
        return "a backslash"
    if _CONTROL.search(path):
        return "a control character"
    segments = path.split("/")[1:]
    if any(segment in (".", "..") for segment in segments):
        return "a '.' or '..' segment"
    if any(segment == "" for segment in segments[:-1]):
        return "an empty segment ('//')"
    return None
