"""`PrefillRoomTable`: the prefill rank's rooms as its event loop sees them, the event
loop's typed handle on its role (run on the engine thread through `EngineLoop.run`):
rooms in progress (each its HTTP call's group) and rooms aborted before they arrived."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass

from kvstrata.disagg.prefill import PrefillHandoff
from kvstrata.disagg.protocol import PrefillResult, PrefillTask
from kvstrata.runtime.engine_loop import EngineLoop
from kvstrata.runtime.request_group import RequestGroup

_MAX_TOMBSTONES = 100_000


@dataclass(frozen=True)
class PrefillActiveRoom:
    """A room a prefill rank is computing: the engine request and its HTTP call's group."""

    rid: str
    group: RequestGroup


class PrefillRoomTable:
    """Rooms in progress and rooms aborted before they arrived. A room aborted first is
    refused when its task arrives late, so an abort acknowledgement is a promise that no
    write will ever come. `role` is None on a rank of another mode (its /pd/abort has no
    write to wait for)."""

    def __init__(self, engine_loop: EngineLoop, role: PrefillHandoff | None) -> None:
        self.engine_loop = engine_loop
        self.role = role
        self.active: dict[str, PrefillActiveRoom] = {}  # by room id
        self.aborted: OrderedDict[str, None] = OrderedDict()

    def tombstone(self, room: str) -> None:
        self.aborted[room] = None
        while len(self.aborted) > _MAX_TOMBSTONES:
            self.aborted.popitem(last=False)

    @property
    def counts(self) -> dict[str, int]:
        return {"prefill_rooms_http": len(self.active)}

    def submit(self, rid: str, task: PrefillTask) -> RequestGroup:
        """Queue the room as engine request `rid`; raises EngineUnavailable."""
        assert self.role is not None, "a prefill rank's route"
        return self.engine_loop.submit_prefill(rid, task, self.role.add_prefill_task)

    async def wait_settled(self, rid: str) -> None:
        """Until the room of request `rid` has its outcome (the write landed or failed)."""
        assert self.role is not None, "a prefill rank's route"
        await asyncio.wrap_future(await self.engine_loop.run(self.role.settled, rid))

    async def collect(self, rid: str) -> PrefillResult:
        """The settled room's result (once); raises TransferError if it failed."""
        assert self.role is not None, "a prefill rank's route"
        return await self.engine_loop.run(self.role.collect, rid)

    async def forget(self, rid: str) -> None:
        """Drop a room nobody will collect."""
        if self.role is not None:
            await self.engine_loop.run(self.role.forget, rid)

    async def wait_write_settled(self, room: str) -> None:
        """Until no write into room `room` is in flight. Once the engine thread ran this,
        it has processed every abort queued before (a write starts only on that thread)."""
        if self.role is not None:
            settled: Future[None] = await self.engine_loop.run(self.role.write_settled, room)
            await asyncio.wrap_future(settled)
