"""Server-sent events: the event encoding and a response that always closes its event
generator, so the generator's cleanup (aborting its engine requests) runs whether the
stream ends, the client disconnects or the server cancels the handler."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Callable

from pydantic import BaseModel
from starlette.requests import ClientDisconnect
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from kvstrata.server.engine_loop import RequestRejected
from kvstrata.server.errors import error_body

DONE_EVENT = "data: [DONE]\n\n"


def sse_event(payload: BaseModel | str) -> str:
    data = payload if isinstance(payload, str) else payload.model_dump_json()
    return f"data: {data}\n\n"


def stream_error(error: Exception) -> str:
    """An error after the stream's headers went out: one OpenAI-shaped error event."""
    status = 400 if isinstance(error, RequestRejected) else 503
    return sse_event(json.dumps(error_body(status, str(error))))


class EventStream(StreamingResponse):
    """Starlette stops iterating when the client disconnects, but leaves a generator that
    is parked at a `yield` to the garbage collector; this closes it at once, then calls
    `on_close` (which also covers a generator that never started)."""

    def __init__(
        self, events: AsyncGenerator[str, None], on_close: Callable[[], None] | None = None
    ) -> None:
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={"cache-control": "no-cache", "x-accel-buffering": "no"},
        )
        self._events = events
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except (OSError, ClientDisconnect):
            pass  # the client is gone; there is nobody to report to
        finally:
            await self._events.aclose()
            if self._on_close is not None:
                self._on_close()
