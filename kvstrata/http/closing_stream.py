"""`ClosingStream`: a streamed response that closes its chunk generator and runs its
cleanup however the response ends, used by a rank's SSE answers and the router's relay."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping

from starlette.requests import ClientDisconnect
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


class ClosingStream(StreamingResponse):
    """However the response ends (body done, client gone, handler cancelled) the chunk
    generator is closed at once, then `on_close` is awaited. Starlette stops iterating
    when the client disconnects but leaves a generator parked at a `yield` to the garbage
    collector, so its cleanup (aborting engine requests, closing an upstream connection)
    would run late or never; `on_close` also covers a generator that never started."""

    def __init__(
        self,
        chunks: AsyncGenerator[str | bytes, None],
        on_close: Callable[[], Awaitable[None]],
        status_code: int = 200,
        headers: Mapping[str, str] | None = None,
        media_type: str | None = None,
    ) -> None:
        super().__init__(chunks, status_code=status_code, headers=headers, media_type=media_type)
        self._chunks = chunks
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except (OSError, ClientDisconnect):
            pass  # the client is gone; there is nobody to report to
        finally:
            await self._chunks.aclose()
            await self._on_close()
