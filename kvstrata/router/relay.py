"""The router's side of a rank's answer: the headers it passes on, reading the first chunk
(or a bounded error body) before anything goes to the client, the `RelayedAnswer` that
passes the rest on chunk by chunk (JSON and SSE alike: no answer is held whole), and
closing the upstream connection so the rank sees its client go."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import anyio
import httpx
from starlette.types import Receive, Scope, Send

from kvstrata.http.closing_stream import ClosingStream

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


async def first_bytes(
    upstream: httpx.Response, chunks: AsyncIterator[bytes], is_stream: bool, max_error_bytes: int
) -> bytes:
    """A stream's first chunk, a JSON answer's first chunk, or (an error status) its
    body read whole, up to `max_error_bytes`; the rest is left in `chunks`."""
    first = await first_chunk(chunks)
    if is_stream or upstream.status_code < 400 or len(first) >= max_error_bytes:
        return first
    return first + await read_bounded(chunks, max_error_bytes - len(first))


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


class UpstreamBroke(Exception):
    """Raised by a relayed body's generator: the rank's connection broke after bytes of a
    JSON answer went out, so no error can be added to it."""


class RelayedAnswer(ClosingStream):
    """A rank's answer passed on as it arrives. If its generator raises UpstreamBroke, the
    response ends without its last body message, so the server drops the connection: the
    client sees a broken answer (an incomplete chunked body), never a short one that
    reads as whole."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Logged where it happened; the server closes the unfinished response.
        with contextlib.suppress(UpstreamBroke):
            await super().__call__(scope, receive, send)
