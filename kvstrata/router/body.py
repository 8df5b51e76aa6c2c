"""A request body on its way through the router: read up to the limit (413 beyond it, no
byte past it kept), parsed only for routing, sent on as a stream (again, byte for byte,
for a retry), and let go as soon as an answer is on its way to the client."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from kvstrata.http.errors import OpenAIError
from kvstrata.router.poison import body_digest
from kvstrata.router.policy import RoutingRequest

RELAY_CHUNK_BYTES = 64 * 1024
HASH_ON_LOOP_BYTES = 256 * 1024  # a larger body is hashed on a worker thread


async def read_body(request: Request, max_body_bytes: int) -> bytearray:
    """The whole body, refused (413) once it passes `max_body_bytes`. Raises
    starlette's ClientDisconnect if the client leaves while sending it."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_body_bytes:  # the gate counts too; this keeps the bound local
            raise OpenAIError(
                413,
                f"the request body exceeds {max_body_bytes} bytes (--max-body-bytes)",
                code="request_too_large",
            )
    return body


def text_chars(body: Any) -> int:
    """Characters of every string in a parsed JSON body: at least the prompt's text.
    Iterative: a body nested as deep as the JSON parser allows must not overflow here."""
    num_chars, pending = 0, [body]
    while pending:
        value = pending.pop()
        if isinstance(value, str):
            num_chars += len(value)
        elif isinstance(value, dict):
            pending.extend(value.values())
        elif isinstance(value, list):
            pending.extend(v for v in value if isinstance(v, (str, dict, list)))
    return num_chars


class RelayBody:
    """The bytes of one request body, sent to a rank as a stream of slices. The same
    bytes can be sent again (to another rank, when an attempt failed before its answer
    reached the client) until `release()`, which the forwarder calls once an answer is
    on its way: a JSON answer read whole, or a stream's first chunk."""

    def __init__(self, data: bytes | bytearray) -> None:
        self._data: bytes | bytearray | None = data
        self.num_bytes = len(data)

    async def chunks(self) -> AsyncIterator[bytes]:
        assert self._data is not None, "the body was released"
        view = memoryview(self._data)
        for start in range(0, len(view), RELAY_CHUNK_BYTES):
            yield bytes(view[start : start + RELAY_CHUNK_BYTES])
        view.release()

    def digest(self, path: str) -> bytes:
        """What the poison ledger knows the request by (router/poison.py)."""
        assert self._data is not None, "the body was released"
        return body_digest(path, self._data)

    async def digest_off_loop(self, path: str) -> bytes:
        """`digest`, on a worker thread for a large body (30 MB: ~20 ms of sha256 here)."""
        if self.num_bytes > HASH_ON_LOOP_BYTES:
            return await asyncio.to_thread(self.digest, path)
        return self.digest(path)

    def release(self) -> None:
        self._data = None


@dataclass
class Outgoing:
    """One request on its way to a rank: its body and what the policy routes it by.
    The forwarder drops both once an answer is on its way (the caller keeps only this)."""

    body: RelayBody | None
    routing: RoutingRequest | None

    def release(self) -> None:
        if self.body is not None:
            self.body.release()
        self.body = self.routing = None
