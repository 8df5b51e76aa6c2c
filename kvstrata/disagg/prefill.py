"""Prefill side of PD disaggregation: a task runs as an ordinary request whose only
output is the first token; when it finishes, its pages for the decode rank's missing
range are written through the transport before the pages go back to the cache."""

from __future__ import annotations

import time
from dataclasses import dataclass

from kvstrata.core import FinishReason, Request
from kvstrata.disagg.handoff import SchedulerEntry
from kvstrata.disagg.protocol import PrefillResult, PrefillTask
from kvstrata.disagg.transport.base import KVSender, TransferError
from kvstrata.engine.scheduler import Scheduler


@dataclass
class _Room:
    task: PrefillTask
    result: PrefillResult | None = None
    error: str | None = None


@dataclass
class TransferStats:
    """What this rank's transfers wrote; `seconds` spans each write call (gather, copy,
    scatter, and the wait until the data is in place), so bytes / seconds is the
    bandwidth a room sees."""

    num_writes: int = 0
    num_pages: int = 0
    kv_bytes: int = 0
    seconds: float = 0.0


class PrefillHandoff(SchedulerEntry):
    def __init__(self, scheduler: Scheduler, sender: KVSender, page_size: int) -> None:
        super().__init__(scheduler)
        self.sender = sender
        self.page_size = page_size
        self.rooms: dict[str, _Room] = {}  # by request id, until the server collects it
        self.stats = TransferStats()

    def track(self, rid: str, task: PrefillTask) -> None:
        self.rooms[rid] = _Room(task)

    def before_release(self, req: Request, reason: FinishReason) -> None:
        """Write the decode rank's missing pages while the request still holds them. An
        aborted request writes nothing (its decode rank already gave the room up)."""
        room = self.rooms.get(req.rid)
        if room is None:
            return
        if reason is FinishReason.ABORT:
            del self.rooms[req.rid]
            return
        task = room.task
        first_page = task.prefix_len // self.page_size
        end_page = -(-req.prompt_len // self.page_size)
        src_page_ids = req.page_ids[first_page:end_page]
        start_s = time.perf_counter()
        try:
            self.sender.write(task.decode_endpoint, src_page_ids, task.dst_page_ids)
        except TransferError as e:
            room.error = str(e)
            return
        if src_page_ids:
            self.stats.num_writes += 1
            self.stats.num_pages += len(src_page_ids)
            self.stats.kv_bytes += len(src_page_ids) * self.sender.pool.page_bytes
            self.stats.seconds += time.perf_counter() - start_s
        room.result = PrefillResult(
            room=task.room,
            first_token_id=req.output_ids[0],
            num_pages_written=len(src_page_ids),
            prefill_cached_tokens=req.num_cached_tokens,
        )

    def collect(self, rid: str) -> PrefillResult:
        """The outcome of a finished room (once); raises TransferError if it failed."""
        room = self.rooms.pop(rid)
        if room.result is None:
            raise TransferError(room.error or f"room {room.task.room} finished without a transfer")
        return room.result

    def forget(self, rid: str) -> None:
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
