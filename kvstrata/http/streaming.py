"""Server-sent events: the event encoding and `EventStream`, a rank's SSE answer (a
`ClosingStream`: the generator's cleanup, aborting its engine requests, runs whether the
stream ends, the client disconnects or the server cancels the handler)."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Callable

from pydantic import BaseModel

from kvstrata.http.closing_stream import ClosingStream
from kvstrata.http.errors import StatusError, error_body

DONE_EVENT = "data: [DONE]\n\n"
# Proxies must pass each event on as it comes, not buffer the answer.
_SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def sse_event(payload: BaseModel | str) -> str:
    data = payload if isinstance(payload, str) else payload.model_dump_json()
    return f"data: {data}\n\n"


def stream_error(error: StatusError) -> str:
    """An error after the stream's headers went out: one OpenAI-shaped error event."""
    return sse_event(json.dumps(error_body(error.status_code, str(error), code=error.code)))


class EventStream(ClosingStream):
    """An SSE answer that closes its event generator however the response ends, then
    calls `on_close` (e.g. closing the request group: its engine requests abort)."""

    def __init__(
        self, events: AsyncGenerator[str, None], on_close: Callable[[], None] | None = None
    ) -> None:
        async def close() -> None:
            if on_close is not None:
                on_close()

        super().__init__(events, close, media_type="text/event-stream", headers=_SSE_HEADERS)
