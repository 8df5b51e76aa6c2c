"""Work that ends when its client leaves: `until_disconnect` awaits it, but cancels it and
answers None once the ASGI receive channel says the client disconnected (ranks and the
router alike)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request

T = TypeVar("T")


async def until_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """Await `work`, but cancel it and return None if the client disconnects first."""
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch_task.cancel()
        if not work_task.done():
            work_task.cancel()
            await asyncio.gather(work_task, return_exceptions=True)
    return work_task.result() if not work_task.cancelled() else None


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
