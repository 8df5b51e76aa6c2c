"""Prefill side of PD disaggregation: a task runs as an ordinary request whose only
output is the first token; when it finishes, its pages for the decode rank's missing
range are written through the transport, and they go back to the cache only once the
write settled (the engine keeps stepping meanwhile)."""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from kvstrata.core import FinishReason, Request
from kvstrata.disagg.handoff import SchedulerEntry
from kvstrata.disagg.protocol import PrefillResult, PrefillTask
from kvstrata.disagg.transport.base import KVSender, PendingWrite, TransferError
from kvstrata.engine.scheduler import Scheduler


def _settled_future() -> Future[None]:
    future: Future[None] = Future()
    future.set_result(None)
    return future


@dataclass
class _Room:
    task: PrefillTask
    result: PrefillResult | None = None
    error: str | None = None
    # Done once the room's write ended (landed, failed or never started); set on the
    # engine thread, awaited by the server before it collects or confirms an abort.
    settled: Future[None] = field(default_factory=Future)

    def settle(self, result: PrefillResult | None, error: str | None) -> None:
        self.result, self.error = result, error
        self.settled.set_result(None)


@dataclass
class _Sending:
    """A finished request whose pages are being written; it keeps them until the write
    settles, then the handoff releases them."""

    req: Request
    room: _Room
    write: PendingWrite
    num_pages: int
    start_s: float  # perf_counter when the write started
    prefill_s: float  # from the task's arrival to its first token


@dataclass
class TransferStats:
    """What this rank's transfers wrote; `seconds` spans each write from its start until
    the engine saw it land (gather, copy, scatter, the wait until the data is in place,
    and up to one engine step), so bytes / seconds is the bandwidth a room sees."""

    num_writes: int = 0
    num_pages: int = 0
    kv_bytes: int = 0
    seconds: float = 0.0


class PrefillHandoff(SchedulerEntry):
    """Rooms by request id until the server collects them, and the writes in flight by
    room id. Writes never block the engine thread: a transport returns a `PendingWrite`
    (Mooncake: a job on a worker; `ipc` on CUDA: a kernel queued on the prefill GPU),
    polled before every step."""

    def __init__(self, scheduler: Scheduler, sender: KVSender, page_size: int) -> None:
        super().__init__(scheduler)
        self.sender = sender
        self.page_size = page_size
        self.rooms: dict[str, _Room] = {}  # by request id, until the server collects it
        self.sending: dict[str, _Sending] = {}  # by room id, while its write is in flight
        self.stats = TransferStats()

    @property
    def num_unfinished(self) -> int:
        return len(self.sending)

    def track(self, rid: str, task: PrefillTask) -> None:
        self.rooms[rid] = _Room(task)

    def before_release(self, req: Request, reason: FinishReason) -> bool:
        """Start writing the decode rank's missing pages while the request still holds
        them; True (keep the pages) while that write is in flight. An aborted request
        writes nothing (its decode rank already gave the room up)."""
        room = self.rooms.get(req.rid)
        if room is None:
            return False
        if reason is FinishReason.ABORT:
            del self.rooms[req.rid]
            room.settle(None, "aborted")
            return False
        task = room.task
        first_page = task.prefix_len // self.page_size
        end_page = -(-req.prompt_len // self.page_size)
        src_page_ids = req.page_ids[first_page:end_page]
        prefill_s = time.monotonic() - req.arrival_s
        start_s = time.perf_counter()
        try:
            write = self.sender.start(task.decode_endpoint, src_page_ids, task.dst_page_ids)
            sending = _Sending(req, room, write, len(src_page_ids), start_s, prefill_s)
            if write.poll():
                self._landed(sending)
                return False
        except TransferError as e:
            room.settle(None, str(e))
            return False
        self.sending[task.room] = sending
        return True

    def before_step(self) -> None:
        """Settle the writes that ended; their requests' pages go back to the cache."""
        for room_id, sending in list(self.sending.items()):
            try:
                if not sending.write.poll():
                    continue
                self._landed(sending)
            except TransferError as e:
                sending.room.settle(None, str(e))
            del self.sending[room_id]
            self.scheduler.kv.release(sending.req)

    def _landed(self, sending: _Sending) -> None:
        req, room = sending.req, sending.room
        send_s = time.perf_counter() - sending.start_s
        if sending.num_pages:
            self.stats.num_writes += 1
            self.stats.num_pages += sending.num_pages
            self.stats.kv_bytes += sending.num_pages * self.sender.pool.page_bytes
            self.stats.seconds += send_s
        room.settle(
            PrefillResult(
                room=room.task.room,
                first_token_id=req.output_ids[0],
                num_pages_written=sending.num_pages,
                prefill_cached_tokens=req.num_cached_tokens,
                prefill_s=sending.prefill_s,
                send_s=send_s,
            ),
            None,
        )

    def settled(self, rid: str) -> Future[None]:
        """Done once the room of request `rid` has its outcome (now, if it has none)."""
        room = self.rooms.get(rid)
        return room.settled if room is not None else _settled_future()

    def write_settled(self, room_id: str) -> Future[None]:
        """Done once no write into room `room_id` is in flight: after it, none can land
        (but a write the transport gave up on: see `PendingWrite.poll`)."""
        sending = self.sending.get(room_id)
        return sending.room.settled if sending is not None else _settled_future()

    def collect(self, rid: str) -> PrefillResult:
        """The outcome of a settled room (once); raises TransferError if it failed."""
        room = self.rooms.pop(rid)
        assert room.settled.done(), "collect a room only once it settled"
        if room.result is None:
            raise TransferError(room.error or f"room {room.task.room} finished without a transfer")
        return room.result

    def forget(self, rid: str) -> None:
        """Drop a room nobody will collect; a write in flight still settles."""
        self.rooms.pop(rid, None)

    def metrics(self) -> dict[str, float]:
        return {
            "pd_sent_writes": self.stats.num_writes,
            "pd_sent_pages": self.stats.num_pages,
            "pd_sent_bytes": self.stats.kv_bytes,
            "pd_send_seconds": self.stats.seconds,
        }

    def close(self) -> None:
        self.sender.close()
