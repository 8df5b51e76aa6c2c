"""The router's side of a rank's answer: the headers it passes on, reading the first chunk
(or a bounded error body) before anything goes to the client, and closing the upstream
connection so the rank sees its client go (the rest is relayed by a `ClosingStream`)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import httpx

# Response headers worth relaying; hop-by-hop ones (length, encoding) are the router's own.
_RELAYED_HEADERS = ("content-type", "cache-control", "x-accel-buffering")


def relayed_headers(upstream: httpx.Response) -> dict[str, str]:
    return {k: upstream.headers[k] for k in _RELAYED_HEADERS if k in upstream.headers}


def is_event_stream(headers: dict[str, str]) -> bool:
    return headers.get("content-type", "").startswith("text/event-stream")


async def first_chunk(chunks: AsyncIterator[bytes]) -> bytes:
    """The first non-empty chunk of a body (b"" if the body is empty); the iterator goes
    on from the chunk after it."""
    async for chunk in chunks:
        if chunk:
            return chunk
    return b""


async def read_bounded(chunks: AsyncIterator[bytes], max_bytes: int) -> bytes:
    """At most `max_bytes` of what is left of a body; the rest is left unread."""
    content = bytearray()
    async for chunk in chunks:
        content += chunk[: max_bytes - len(content)]
        if len(content) >= max_bytes:
            break
    return bytes(content)


async def close_upstream(upstream: httpx.Response) -> None:
    # Shielded: this runs while the handler is being cancelled for a client disconnect,
    # and an unfinished close would leave the rank generating for nobody.
    with anyio.CancelScope(shield=True):
        await upstream.aclose()
