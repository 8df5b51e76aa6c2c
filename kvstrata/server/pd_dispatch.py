"""Both ends of PD rooms in a rank's server. `PrefillRooms`: the prefill rank's table of
rooms in progress and rooms aborted. `PrefillDispatcher`: the decode rank's sender of
preallocated rooms, which frees a failed or abandoned room's pages only once no write
can still land in them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from typing import Any

import httpx

from kvstrata.disagg.decode import PrefillDispatch
from kvstrata.disagg.protocol import PrefillResult, PrefillTask
from kvstrata.disagg.transport.base import TransferError
from kvstrata.errors_text import describe_error
from kvstrata.server.engine_loop import EngineLoop
from kvstrata.server.request_group import EngineUnavailable

logger = logging.getLogger("kvstrata.pd")
_MAX_TOMBSTONES = 100_000


class PrefillRooms:
    """Prefill side: rooms in progress (room -> its request group) and rooms aborted
    before they arrived. A room aborted first is refused when its task arrives late, so
    an abort acknowledgement is a promise that no write will ever come."""

    def __init__(self) -> None:
        self.active: dict[str, Any] = {}
        self.aborted: OrderedDict[str, None] = OrderedDict()

    def tombstone(self, room: str) -> None:
        self.aborted[room] = None
        while len(self.aborted) > _MAX_TOMBSTONES:
            self.aborted.popitem(last=False)


class PrefillDispatcher:
    """Decode side. Lives on the event loop; the engine thread hands it preallocated
    rooms and the requests it prefills itself (`on_dispatch`); it reports back through
    `EngineLoop.call`."""

    def __init__(
        self, engine_loop: EngineLoop, timeout_s: float, api_key: str | None = None
    ) -> None:
        self.engine_loop = engine_loop
        self.timeout_s = timeout_s
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(headers=headers, timeout=timeout_s)
        self.targets: dict[str, str] = {}  # rid -> prefill URL, set when submitted
        self._inflight: dict[str, asyncio.Task[None]] = {}
        self._cancelled: set[str] = set()
        self._settling: set[str] = set()  # rooms whose `_run` took its cancellation
        self.num_failed_rooms = 0

    def on_tasks(self, tasks: list[PrefillTask]) -> None:
        self.on_dispatch(PrefillDispatch(tasks, []))

    def on_dispatch(self, dispatch: PrefillDispatch) -> None:
        for rid in dispatch.local_rids:  # prefilled on this rank: no prefill rank needed
            self.targets.pop(rid, None)
            self._cancelled.discard(rid)
        for task in dispatch.tasks:
            url = self.targets.pop(task.room, None)
            if task.room in self._cancelled or url is None:
                self._cancelled.discard(task.room)
                self._spawn(task.room, self._release(task.room))
                continue
            self._spawn(task.room, self._run(url, task), url)

    def cancel(self, rids: list[str]) -> None:
        """Requests went away (client disconnect or abort): stop their rooms."""
        for rid in rids:
            self.targets.pop(rid, None)
            task = self._inflight.get(rid)
            if task is not None:
                task.cancel()
            else:
                self._cancelled.add(rid)

    def _spawn(self, room: str, work: Any, url: str | None = None) -> None:
        task = asyncio.ensure_future(work)
        self._inflight[room] = task

        def done(finished: asyncio.Task[None]) -> None:
            self._inflight.pop(room, None)
            if url is not None and finished.cancelled() and room not in self._settling:
                # Cancelled before `_run` began: no handler of its ran, so the room (a
                # zombie once the engine aborts it) still needs settling.
                self._spawn(room, self._settle(url, room, None))
            self._settling.discard(room)

        task.add_done_callback(done)

    async def _run(self, url: str, task: PrefillTask) -> None:
        try:
            response = await self._client.post(f"{url}/pd/prefill", json=task.to_json())
            if response.status_code != 200:
                raise TransferError(f"prefill rank {url} answered {response.status_code}: "
                                    f"{response.text[:200]}")  # fmt: skip
            result = PrefillResult.from_json(response.json())
            await self.engine_loop.call(
                lambda engine: self.engine_loop.deliver([engine.complete_transfer(result)])
            )
        except asyncio.CancelledError:
            self._settling.add(task.room)
            await asyncio.shield(self._settle(url, task.room, None))
            raise
        except (httpx.HTTPError, TransferError, ValueError, TypeError) as e:
            message = f"prefill for this request failed: {describe_error(e)}"
            logger.warning("room %s: %s", task.room, message)
            self.num_failed_rooms += 1
            await self._settle(url, task.room, message)

    async def _settle(self, url: str, room: str, message: str | None) -> None:
        """Fail the request now (if `message`); free its pages once the prefill rank
        promised not to write (or cannot: it is gone)."""
        if message is not None:
            with contextlib.suppress(EngineUnavailable):
                await self.engine_loop.call(
                    lambda engine: self.engine_loop.deliver(
                        [out] if (out := engine.fail_room(room, message)) else []
                    )
                )
        await self._abort_remote(url, room)
        await self._release(room)

    async def _abort_remote(self, url: str, room: str) -> None:
        delay_s = 0.1
        while True:
            try:
                response = await self._client.post(f"{url}/pd/abort", json={"room": room})
                if response.status_code == 200:
                    return
            except httpx.ConnectError:
                return  # nothing listens there any more: no write can come
            except httpx.HTTPError:
                pass
            logger.warning("room %s: prefill rank %s has not confirmed the abort", room, url)
            await asyncio.sleep(delay_s)
            delay_s = min(delay_s * 2, 5.0)

    async def _release(self, room: str) -> None:
        with contextlib.suppress(EngineUnavailable):
            await self.engine_loop.call(lambda engine: engine.release_room(room))

    async def close(self) -> None:
        for task in list(self._inflight.values()):
            task.cancel()
        await asyncio.gather(*self._inflight.values(), return_exceptions=True)
        await self._client.aclose()
