"""`describe_error`: an exception as text that always says what failed, also when its
`str()` is empty (httpx timeouts, bare `TimeoutError()`): the type name, which timeout
ran out and the URL it was talking to."""

from __future__ import annotations

import httpx

# Which entry of httpx's timeout dict each timeout class ran out of.
_TIMEOUT_KINDS: dict[type[httpx.TimeoutException], str] = {
    httpx.ConnectTimeout: "connect",
    httpx.ReadTimeout: "read",
    httpx.WriteTimeout: "write",
    httpx.PoolTimeout: "pool",
}


_MAX_CAUSES = 3  # exceptions chained by `raise ... from` that an empty message follows


def describe_error(error: BaseException, qualified: bool = False, _depth: int = 0) -> str:
    """`str(error)` when it says something (prefixed "TypeName: " if `qualified`);
    otherwise never empty: e.g. "ReadTimeout after 30 s talking to
    http://127.0.0.1:8001/pd/prefill", or "TransferError (caused by ...)" from the
    exception it was raised from."""
    text = str(error).strip()
    if text:
        return f"{type(error).__name__}: {text}" if qualified else text
    parts = [type(error).__name__]
    if isinstance(error, httpx.RequestError) and (request := _request_of(error)) is not None:
        # The timeout and URL say it all; httpx's own chain of causes (httpcore's
        # timeout, anyio's cancel scope) would only add noise.
        timeout_s = _timeout_s(error, request)
        if timeout_s is not None:
            parts.append(f"after {timeout_s:g} s")
        parts.append(f"talking to {request.url}")
        return " ".join(parts)
    cause = error.__cause__ or error.__context__
    if cause is not None and _depth < _MAX_CAUSES:
        parts.append(f"(caused by {describe_error(cause, qualified, _depth + 1)})")
    return " ".join(parts)


def _request_of(error: httpx.RequestError) -> httpx.Request | None:
    try:
        return error.request
    except RuntimeError:  # raised outside a client call: httpx never set it
        return None


def _timeout_s(error: httpx.RequestError, request: httpx.Request) -> float | None:
    if not isinstance(error, httpx.TimeoutException):
        return None
    timeouts = request.extensions.get("timeout")
    kind = next((k for cls, k in _TIMEOUT_KINDS.items() if isinstance(error, cls)), None)
    if not isinstance(timeouts, dict) or kind is None:
        return None
    value = timeouts.get(kind)
    return float(value) if isinstance(value, int | float) else None
