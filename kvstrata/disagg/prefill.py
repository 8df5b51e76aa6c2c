"""Prefill side of PD disaggregation: a task runs as an ordinary request whose only
output is the first token; when it finishes, its pages for the decode rank's missing
range are written through the transport, and they go back to the cache only once the
write settled (the engine keeps stepping meanwhile). The prefill rank's role
(engine/role.py); the server's commands: `add_prefill_task`, `settled`, `collect`,
`forget`, `write_settled`."""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from kvstrata.core import Batch, FinishReason, Request, RequestStatus, SamplingParams
from kvstrata.disagg.protocol import PrefillResult, PrefillTask
from kvstrata.disagg.transport.base import KVSender, PendingWrite, TransferError
from kvstrata.disagg.transport.write_timeline import TIMELINE
from kvstrata.engine.role import EngineServices, SchedulerEntry
from kvstrata.engine.scheduler import Scheduler


def _settled(write: PendingWrite) -> bool:
    """Whether `write` ended, landed or failed."""
    try:
        return write.poll()
    except TransferError:
        return True


def _settled_future() -> Future[None]:
    future: Future[None] = Future()
    future.set_result(None)
    return future


@dataclass
class _PrefillRoom:
    task: PrefillTask
    req: Request | None = None  # the request computing it (to stream its finished pages)
    result: PrefillResult | None = None
    error: str | None = None
    # Done once the room's writes ended (landed, failed or never started); set on the
    # engine thread, awaited by the server before it collects or confirms an abort.
    settled: Future[None] = field(default_factory=Future)
    writes: list[PendingWrite] = field(default_factory=list)  # started, in page order
    num_sent_pages: int = 0  # of the room's pages, those whose write has started
    start_s: float = 0.0  # perf_counter when its first write started

    def settle(self, result: PrefillResult | None, error: str | None) -> None:
        self.result, self.error = result, error
        self.settled.set_result(None)


@dataclass
class _PrefillSending:
    """A finished (or aborted) request whose room still has writes in flight; it keeps
    its pages until they settle, then the handoff releases them."""

    req: Request
    room: _PrefillRoom
    prefill_s: float  # from the task's arrival to its first token
    aborted: bool = False


@dataclass
class TransferStats:
    """What this rank's transfers wrote; `seconds` spans each room from its first write's
    start until the engine saw the last land (gather, copy, scatter, the wait until the
    data is in place, and up to one engine step), so bytes / seconds is the bandwidth a
    room sees."""

    num_writes: int = 0
    num_pages: int = 0
    kv_bytes: int = 0
    seconds: float = 0.0


class PrefillHandoff(SchedulerEntry):
    """Rooms by request id until the server collects them, and the rooms with writes in
    flight by room id. Writes never block the engine thread: a transport returns a
    `PendingWrite` (Mooncake: a job on a worker; `ipc` on CUDA: a kernel queued on the
    prefill GPU), polled before every step. With `stream` (the default), the pages each
    prefill chunk completes start their write before the next step, so the transfer runs
    under the rest of the prefill; a request with writes in flight is pinned in the KV
    manager (never preempted: the writes read its pages)."""

    def __init__(
        self,
        scheduler: Scheduler,
        sender: KVSender,
        page_size: int,
        services: EngineServices,
        stream: bool = True,
    ) -> None:
        super().__init__(scheduler)
        self.services = services
        self.sender = sender
        self.page_size = page_size
        self.stream = stream
        self.kv = scheduler.kv
        self.rooms: dict[str, _PrefillRoom] = {}  # by request id, until the server collects it
        self.sending: dict[str, _PrefillSending] = {}  # by room id, while its writes are in flight
        self.stats = TransferStats()

    @property
    def num_unfinished(self) -> int:
        return len(self.sending)

    @property
    def choices_share_prompt(self) -> bool:
        return False  # each task is one choice of its decode rank's request

    def add_prefill_task(self, task: PrefillTask, rid: str | None = None) -> Request:
        """Compute the task's prompt as request `rid`; its only output is the first token,
        and the decode rank's missing pages are written before its pages are released.
        Raises ValueError (nothing queued) if the engine refuses the prompt."""
        params = SamplingParams(**{**task.sampling, "max_tokens": 1})
        req = self.services.add_request(task.token_ids, params, rid=rid)
        self.rooms[req.rid] = _PrefillRoom(task, req)
        return req

    def _page_range(self, room: _PrefillRoom, req: Request) -> tuple[int, int]:
        """The room's pages in the request's page list: [first, end)."""
        return room.task.prefix_len // self.page_size, -(-req.prompt_len // self.page_size)

    def _send(self, room: _PrefillRoom, req: Request, upto_page: int) -> None:
        """Start the write of the room's pages below `upto_page` not started yet."""
        first_page, _ = self._page_range(room, req)
        begin = first_page + room.num_sent_pages
        if upto_page <= begin:
            return
        if not room.writes:
            room.start_s = time.perf_counter()
        task = room.task
        dst_page_ids = task.dst_page_ids[room.num_sent_pages : upto_page - first_page]
        TIMELINE.mark("room_write", room=task.room)
        # The pages may have been restored from L2/L3 with no batch reading them since:
        # the sender's event on the compute stream must come after those copies.
        self.kv.tiers.fence_loads()
        write = self.sender.start(task.decode_endpoint, req.page_ids[begin:upto_page], dst_page_ids)
        room.writes.append(write)
        room.num_sent_pages = upto_page - first_page
        self.kv.pin(req)

    def before_release(self, req: Request, reason: FinishReason) -> bool:
        """Start writing the rest of the decode rank's missing pages while the request
        still holds them; True (keep the pages) while writes are in flight. An aborted
        request writes nothing more (its decode rank already gave the room up) but keeps
        its pages until the writes it started settle."""
        room = self.rooms.get(req.rid)
        if room is None:
            return False
        aborted = reason is FinishReason.ABORT
        if aborted:
            del self.rooms[req.rid]
        else:
            try:
                self._send(room, req, self._page_range(room, req)[1])
            except TransferError as e:
                room.error = room.error or str(e)
        sending = _PrefillSending(req, room, time.monotonic() - req.arrival_s, aborted)
        if self._settle_if_done(sending):
            return False
        self.sending[room.task.room] = sending
        return True

    def _settle_if_done(self, sending: _PrefillSending) -> bool:
        """Settle the room once none of its writes is in flight (True): its result, or
        its first error, or "aborted"."""
        room = sending.room
        for write in room.writes:
            try:
                if not write.poll():
                    return False
            except TransferError as e:  # failed or given up: it ends here
                room.error = room.error or str(e)
        self.kv.unpin(sending.req)
        if sending.aborted:
            room.settle(None, "aborted")
        elif room.error is not None:
            room.settle(None, room.error)
        else:
            self._landed(sending.req, room, sending.prefill_s)
        return True

    def before_step(self) -> None:
        """Settle the rooms whose writes ended (their requests' pages go back to the
        cache), then stream the pages the last step completed."""
        for room_id, sending in list(self.sending.items()):
            if self._settle_if_done(sending):
                del self.sending[room_id]
                self.kv.release(sending.req)
        if self.stream:
            for room in list(self.rooms.values()):
                self._stream(room)

    def before_forward(self, batch: Batch) -> None:
        """Stream the pages a room holds before its batch computes the rest: a prefix
        cached here (or restored from L2/L3) is written while its suffix is computed,
        rather than after the first chunk."""
        if self.stream:
            for item in batch.items:
                room = self.rooms.get(item.request.rid)
                if room is not None:
                    self._stream(room)

    def _stream(self, room: _PrefillRoom) -> None:
        req = room.req
        if req is None or req.status is not RequestStatus.RUNNING or room.error is not None:
            return
        if all(_settled(write) for write in room.writes):
            # Nothing reads its pages now: it may be preempted again (without this, a pool
            # of pinned requests that cannot grow would wait on each other forever).
            self.kv.unpin(req)
        num_full_pages = req.num_computed_tokens // self.page_size
        try:
            self._send(room, req, min(num_full_pages, self._page_range(room, req)[1]))
        except TransferError as e:
            room.error = str(e)  # the room fails once its request finishes

    def _landed(self, req: Request, room: _PrefillRoom, prefill_s: float) -> None:
        send_s = time.perf_counter() - room.start_s if room.writes else 0.0
        if room.num_sent_pages:
            self.stats.num_writes += 1
            self.stats.num_pages += room.num_sent_pages
            self.stats.kv_bytes += room.num_sent_pages * self.sender.page_bytes
            self.stats.seconds += send_s
        room.settle(
            PrefillResult(
                room=room.task.room,
                first_token_id=req.output_ids[0],
                num_pages_written=room.num_sent_pages,
                prefill_cached_tokens=req.num_cached_tokens,
                prefill_s=prefill_s,
                send_s=send_s,
                first_token_logprobs=req.output_logprobs[0] if req.output_logprobs else None,
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

    # -- integrity (server/invariants.py aggregates it) ---------------------------------

    def page_holders(self) -> list[Request]:
        """Finished requests whose pages are being written (running ones are the
        scheduler's)."""
        return [sending.req for sending in self.sending.values()]

    def ended_holders(self) -> dict[str, Request]:
        return {f"request {s.req.rid} sending its pages": s.req for s in self.sending.values()}

    @property
    def counts(self) -> dict[str, int]:
        # A room outlives its request only until its HTTP handler collects the result.
        return {"prefill_rooms": len(self.rooms), "prefill_sending": len(self.sending)}

    def check_integrity(self) -> list[str]:
        """Each room in flight is its task's and its writes cover only the room's pages."""
        violations = [
            f"prefill sending room {room_id} is room {s.room.task.room}"
            for room_id, s in self.sending.items()
            if s.room.task.room != room_id
        ]
        violations += [
            f"prefill room {room.task.room} started {room.num_sent_pages} of "
            f"{len(room.task.dst_page_ids)} pages"
            for room in [*self.rooms.values(), *(s.room for s in self.sending.values())]
            if room.num_sent_pages > len(room.task.dst_page_ids)
        ]
        return violations
