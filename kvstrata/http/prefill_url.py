"""The prefill rank a decode rank's request names: `X-Kvstrata-Prefill-Url`, taken only from
a caller holding the cluster key (the router) and only as a well-formed http(s) origin."""

from __future__ import annotations

import urllib.parse

from fastapi import Request

from kvstrata.http.errors import OpenAIError
from kvstrata.http.middleware import CLUSTER_KEY_HEADER, PREFILL_URL_HEADER, holds_cluster_key

_MAX_URL_CHARS = 2048


def requested_prefill_url(request: Request, cluster_key: str | None) -> str | None:
    """The header's URL (normalized), None without the header. Raises OpenAIError: 401 if
    the caller lacks the cluster key (a client could otherwise point the rank at a server
    of its own, whose pages would be admitted as the prompt's KV), 400 if it is no URL."""
    text = request.headers.get(PREFILL_URL_HEADER)
    if text is None:
        return None
    if not holds_cluster_key(request.scope["headers"], cluster_key):
        raise OpenAIError(
            401,
            f"{PREFILL_URL_HEADER} is taken only from the router (a caller sending the "
            f"cluster key in {CLUSTER_KEY_HEADER})",
            PREFILL_URL_HEADER,
            "invalid_cluster_key",
        )
    return parse_prefill_url(text)


def parse_prefill_url(text: str) -> str:
    """`scheme://host[:port]` of an http(s) URL with nothing else (path `/` at most);
    OpenAIError(400) for anything else, before any room exists."""
    try:
        if len(text) > _MAX_URL_CHARS:
            raise ValueError(f"longer than {_MAX_URL_CHARS} characters")
        parts = urllib.parse.urlsplit(text.strip())
        port = parts.port  # raises ValueError for a port that is not a number in range
        if parts.scheme not in ("http", "https"):
            raise ValueError("not an http(s) URL")
        if not parts.hostname or parts.username is not None or parts.password is not None:
            raise ValueError("no host, or a user name in it")
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise ValueError("a prefill rank URL has no path, query or fragment")
        if any(c.isspace() or ord(c) < 0x21 for c in parts.netloc):
            raise ValueError("spaces or control characters in the host")
    except ValueError as e:
        raise OpenAIError(
            400,
            f"{PREFILL_URL_HEADER}: {text[:200]!r} is not a prefill rank URL ({e})",
            PREFILL_URL_HEADER,
            "invalid_prefill_url",
        ) from None
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{parts.scheme}://{host}" + (f":{port}" if port is not None else "")
