"""The decode rank's room sender with a stand-in engine loop: a room whose client leaves
is settled (aborted remotely, its pages released) however early the leave comes, also
before the coroutine that sends the room has begun."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from kvstrata.disagg.protocol import PrefillTask
from kvstrata.disagg.rooms import Attempts, SentRoom
from kvstrata.pd.decode_sender import DecodeRoomSender

NOBODY = "http://127.0.0.1:1"  # nothing listens: the remote abort ends at once


class FakeEngine:
    def __init__(self) -> None:
        self.released: list[str] = []
        self.failed: list[str] = []

    def release_room(self, rid: str) -> bool:
        self.released.append(rid)
        return True

    def fail_room(self, rid: str, message: str) -> None:
        self.failed.append(rid)


class FakeLoop:
    """What the sender uses of EngineLoop: `run` runs a role command on the engine."""

    def __init__(self) -> None:
        self.engine = FakeEngine()

    async def run(self, command: Callable[..., Any], *args: Any) -> Any:
        return command(*args)

    async def run_output(self, command: Callable[..., Any], *args: Any) -> None:
        command(*args)


def task(room: str) -> PrefillTask:
    return PrefillTask(room, [1, 2, 3], 0, [0], {"backend": "ipc"})


def sent(room: str) -> list[SentRoom]:
    return [SentRoom(room, NOBODY, task(room), Attempts())]


def test_a_room_cancelled_before_its_sender_started_is_still_released() -> None:
    async def main() -> FakeEngine:
        loop = FakeLoop()
        dispatcher = DecodeRoomSender(loop, loop.engine, timeout_s=5)  # type: ignore[arg-type]
        dispatcher.send(sent("r1"))
        dispatcher.stop(["r1"])  # before the sender's first step
        for _ in range(100):
            if loop.engine.released:
                break
            await asyncio.sleep(0.01)
        await dispatcher.close()
        return loop.engine

    engine = asyncio.run(main())
    assert engine.released == ["r1"] and engine.failed == []


def test_a_room_cancelled_while_sending_is_released_once() -> None:
    async def main() -> FakeEngine:
        loop = FakeLoop()
        dispatcher = DecodeRoomSender(loop, loop.engine, timeout_s=5)  # type: ignore[arg-type]
        dispatcher.send(sent("r2"))
        await asyncio.sleep(0)  # the sender starts (and fails to connect, or is cancelled)
        dispatcher.stop(["r2"])
        for _ in range(100):
            if loop.engine.released:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        await dispatcher.close()
        return loop.engine

    engine = asyncio.run(main())
    assert engine.released == ["r2"]


def test_a_room_cancelled_before_its_sender_started_leaves_nothing_active() -> None:
    async def main() -> dict[str, int]:
        loop = FakeLoop()
        dispatcher = DecodeRoomSender(loop, loop.engine, timeout_s=5)  # type: ignore[arg-type]
        dispatcher.send(sent("r3"))
        dispatcher.stop(["r3"])  # before the sender's first step: its `finally` never runs
        for _ in range(100):
            if loop.engine.released:
                break
            await asyncio.sleep(0.01)
        counts = dispatcher.counts
        await dispatcher.close()
        return counts

    assert asyncio.run(main()) == {"dispatcher_targets": 0, "dispatcher_active": 0}
