"""Decode side of PD disaggregation: after its prefix match a request either goes to this
rank's own scheduler (local prefill) or gets a room (rooms.py): pages (prealloc), then its
prompt KV (transfer from the prefill rank, restore from L2/L3, the L3 part possibly beside
the transfer), then it joins the running batch (landing.py). The decode rank's role
(engine/role.py): owned by the engine thread; SENT rooms go to its `RoomSink` (the
server's sender), which reports back through its commands (`complete_transfer`,
`fail_room`, `requeue_room`, `release_room`)."""

from __future__ import annotations

import time
from dataclasses import asdict

from kvstrata.core import (
    Batch,
    ErrorKind,
    FinishReason,
    PrefillPath,
    Request,
    RequestOutput,
    TierMatch,
)
from kvstrata.disagg.landing import Landing
from kvstrata.disagg.local_prefill import LocalPrefillPolicy, NeverLocal
from kvstrata.disagg.prefill_costs import PrefillDemand
from kvstrata.disagg.protocol import PrefillResult, PrefillTask
from kvstrata.disagg.restore import L3Restores, RestoreSpan, SerialRestore
from kvstrata.disagg.rooms import Room, RoomSink, RoomState, RoomTable, SentRoom
from kvstrata.disagg.transport.base import KVReceiver, TransferError
from kvstrata.engine.kv_manager import RequestKV
from kvstrata.engine.role import EngineServices
from kvstrata.engine.scheduler import Scheduler

# Rooms whose request waits for its KV, holding pages (the role's own, not a zombie's).
_WAITING = (RoomState.PREALLOCATED, RoomState.SENT)


class DecodeHandoff:
    """Invariant: a request with a room that is not a ZOMBIE is WAITING and in no
    scheduler queue; only its `Landing` makes it RUNNING, as its room leaves the table."""

    def __init__(
        self,
        kv: RequestKV,
        scheduler: Scheduler,
        receiver: KVReceiver,
        page_bytes: int,
        services: EngineServices,
        vocab_size: int,
        prealloc_timeout_s: float = 0.0,
        policy: LocalPrefillPolicy | None = None,
        restores: L3Restores | None = None,
    ) -> None:
        self.kv = kv
        self.services = services
        self.vocab_size = vocab_size
        self.scheduler = scheduler
        self.receiver = receiver
        self.prealloc_timeout_s = prealloc_timeout_s  # 0: queued requests wait forever
        self.page_bytes = page_bytes
        self.policy = policy if policy is not None else NeverLocal()
        self.restores = restores if restores is not None else SerialRestore()
        self.page_size = kv.page_size
        self.table = RoomTable(self.page_size)
        self.landing = Landing(kv, scheduler, self.table, self.restores, self.policy)
        # None (in process): SENT rooms wait for `take_tasks`; else each step's go there.
        self.sink: RoomSink | None = None

    def send_to(self, sink: RoomSink) -> None:
        """Hand SENT rooms to `sink` from now on (before the engine thread starts)."""
        self.sink = sink

    @property
    def num_unfinished(self) -> int:
        return len(self.table)

    # -- views by state (tests and integrity) --------------------------------------------

    @property
    def queue(self) -> list[Request]:
        """Requests waiting for pages, first to get them first."""
        return [room.req for room in self.table.queued()]

    @property
    def rooms(self) -> dict[str, Request]:
        """Room id -> request, for rooms whose transfer is awaited."""
        return self.table.requests_in(*_WAITING)

    @property
    def restoring(self) -> dict[str, Request]:
        """Rooms whose transfer landed while claimed L3 pages are still on the way."""
        return self.table.requests_in(RoomState.RESTORING)

    @property
    def zombies(self) -> dict[str, Request]:
        """Room id -> the stand-in holding its pages until `release_room`."""
        return self.table.requests_in(RoomState.ZOMBIE)

    def add(self, req: Request) -> None:
        self.table.queue(req)

    def aim(self, prefill_url: str | None, rids: list[str]) -> None:
        """New requests (before any step saw them): their rooms go to `prefill_url`; None:
        no prefill rank was named for them, so this rank prefills them."""
        for rid in rids:
            room = self.table.room_of(rid)
            if room is None:
                continue  # it ended already
            if prefill_url is None:
                self._go_local(room)
            else:
                self.table.aim(room.room_id, prefill_url)

    def holds(self, req: Request) -> bool:
        room = self.table.room_of(req.rid)
        return room is not None and room.req is req

    def request_in(self, room_id: str) -> Request | None:
        """The request room `room_id` fills, while its transfer is awaited."""
        room = self.table.get(room_id)
        return room.req if room is not None and room.state in _WAITING else None

    def room_of(self, rid: str) -> str | None:
        room = self.table.room_of(rid)
        return room.room_id if room is not None else None

    def before_release(self, req: Request, reason: FinishReason) -> bool:
        return False

    def before_forward(self, batch: Batch) -> None:
        pass

    def before_step(self) -> None:
        """Settle the L3 restores that finished. Choose each matched request's path;
        local ones go to the scheduler. Prealloc the remote ones: plan the whole queue in
        one pass (FIFO; a request that does not fit stops the pass), evict once for all of
        it, attach, and hand the new rooms out.

            [0, l1_len) L1 | [l1_len, match) from L2 | [match, claimed) L3 read in flight
            | [claimed, prompt_len) sent
        """
        for outcome in self.restores.poll():
            self.landing.restored(outcome)
        if not self.table.num_queued:
            return  # most steps: nothing waits (and the sums below walk every request)
        plans: list[tuple[Room, TierMatch, RestoreSpan | None]] = []
        num_planned_pages = 0
        reserve = len(self.scheduler.running)  # room for running requests to grow
        num_local_tokens = self.scheduler.num_prefill_tokens_left
        for room in self.table.queued():
            req, span = room.req, None
            ready = self.kv.prefetch_ready(req)
            match = self.kv.match(req, whole_prompt=True)
            if not ready:
                span = self.restores.span_for(req, match)
                if span is None:
                    continue  # waiting for L3, not for room: later requests may go
            claimed_len = match.prefix_len if span is None else span.end_page * self.page_size
            if req.prefill_path is None:
                num_uncached = max(req.prompt_len - claimed_len, 1)
                demand = PrefillDemand(
                    num_uncached, num_local_tokens, len(self.scheduler.running), req.prompt_len
                )
                if self.policy.prefers_local(demand):
                    self._go_local(room)
                    num_local_tokens += num_uncached
                    continue
                req.prefill_path = PrefillPath.REMOTE
            self.kv.tiers.lock(match)
            num_pages = self.kv.num_pages_for(req.prompt_len) - match.l1.num_pages
            if num_planned_pages + num_pages + reserve > self.kv.num_available_pages:
                self.kv.tiers.unlock(match)
                break
            num_planned_pages += num_pages
            plans.append((room, match, span))
        self.kv.make_free(num_planned_pages)
        for room, match, span in plans:
            req = room.req
            self.kv.attach_locked(req, match, req.prompt_len)
            claimed_len = match.prefix_len
            if span is not None:  # span.end_page >= the match's pages
                self.restores.begin(room.room_id, req, span)
                claimed_len = span.end_page * self.page_size
            task = self._task(room.room_id, req, claimed_len)
            self.table.preallocate(room.room_id, task, len(task.dst_page_ids) * self.page_bytes)
        if self.sink is not None and plans:
            self.sink.rooms_sent([_sent(room) for room in self.table.hand_out()])

    def _go_local(self, room: Room) -> None:
        """The scheduler prefills the room's request (matching again at admission: what a
        tier lost meanwhile is computed too) and samples its first token here."""
        self.table.go_local(room.room_id)
        room.req.prefill_path = PrefillPath.LOCAL
        self.scheduler.add(room.req)

    def observe_step(self, batch: Batch, step_s: float) -> None:
        """Calibrates the local path's costs: the step's prompt tokens (all but its
        decodes, one token each) against its time. Counted here, not in the stepper, so
        ranks of other roles pay nothing per step."""
        num_decodes = sum(1 for item in batch.items if item.num_new_tokens == 1 and item.samples)
        self.policy.observe_step(batch.num_tokens - num_decodes, step_s, num_decodes)

    @property
    def choices_share_prompt(self) -> bool:
        return False  # each choice gets its own room

    @property
    def max_local_prefill_tokens(self) -> int:
        scheduler = self.scheduler
        demand = PrefillDemand(0, scheduler.num_prefill_tokens_left, len(scheduler.running), 0)
        return self.policy.max_local_tokens(demand)

    def _task(self, room_id: str, req: Request, prefix_len: int) -> PrefillTask:
        first_page = prefix_len // self.page_size
        return PrefillTask(
            room=room_id,
            token_ids=req.prompt_ids,
            prefix_len=prefix_len,
            dst_page_ids=req.page_ids[first_page : self.kv.num_pages_for(req.prompt_len)],
            decode_endpoint=self.receiver.endpoint(),
            sampling=asdict(req.params),
        )

    def take_expired(self) -> list[Request]:
        """Queued requests (no pages yet) that arrived more than `prealloc_timeout_s` ago:
        without a bound, rooms that a frozen prefill rank never releases could make every
        later request wait forever. They stay queued until the engine finishes them."""
        if not self.prealloc_timeout_s or not self.table.num_queued:
            return []
        oldest_ok_s = time.monotonic() - self.prealloc_timeout_s
        return [room.req for room in self.table.queued() if room.req.arrival_s < oldest_ok_s]

    def take_tasks(self) -> list[PrefillTask]:
        """In process (no sink): the rooms preallocated since the last call, now SENT."""
        return [room.task for room in self.table.hand_out() if room.task is not None]

    def complete_transfer(self, result: PrefillResult) -> RequestOutput:
        """The room's KV arrived; the request starts decoding from the prefill rank's first
        token. Raises TransferError (the caller fails the room) if the handoff is
        inconsistent."""
        if not 0 <= result.first_token_id < self.vocab_size:
            raise TransferError(
                f"room {result.room}: first token id {result.first_token_id} is outside the "
                f"vocabulary [0, {self.vocab_size})"
            )
        req = self.landing.land(result)
        return self.services.commit_token(req, result.first_token_id, result.first_token_logprobs)

    def fail_room(
        self, room_id: str, message: str, kind: ErrorKind = ErrorKind.UNAVAILABLE
    ) -> RequestOutput | None:
        """The room's transfer failed: its request ends with `message` (None if it is
        gone); `kind` FAILED if the request caused it. Its pages stay held until
        `release_room`."""
        req = self.request_in(room_id)
        return self.services.fail_request(req, message, kind) if req is not None else None

    def drop(self, req: Request) -> None:
        """A request leaves before its KV arrived (abort or failure). Queued, or
        preallocated but never handed out: forgotten (its pages freed) at once. SENT: its
        pages wait as a zombie until `release_room`, because the prefill rank may still be
        writing into them (the sink is told). Transfer landed, L3 pages awaited: released
        at once (its valid KV, `num_computed_tokens`, goes to the cache)."""
        room = self.table.room_of(req.rid)
        if room is None:
            return
        self.restores.forget(room.room_id)
        if room.state is RoomState.SENT:
            self.table.zombify(room.room_id, req)
            if self.sink is not None:
                self.sink.rooms_dropped([room.room_id])
            return
        state = room.state
        self.table.withdraw(room.room_id)
        if state is RoomState.QUEUED:
            self.kv.forget(req)
        else:
            self.kv.release(req)

    def requeue_room(
        self, room_id: str, path: PrefillPath, target: str | None = None, why: str = ""
    ) -> bool:
        """Room `room_id` failed (its prefill rank is dead, frozen or wrote wrongly, for
        `why`) and its request lives on: a stand-in keeps the room's pages as a zombie
        until no write can land, and the request starts again with no pages, on `path`
        (remote: a new room, to `target`, ahead of the queue, its history one failure
        longer; local: this rank's scheduler). False if no such room is out."""
        room = self.table.get(room_id)
        if room is None or room.state is not RoomState.SENT:
            return False
        req = room.req
        self.restores.forget(room_id)
        self.table.zombify(room_id, self.kv.hand_over(req))  # the pages and the prefix lock
        req.prefill_path = path
        if path is PrefillPath.LOCAL:
            self.scheduler.add(req)
        else:
            history = room.history.then(room.target or "", why)
            self.table.queue(req, target, history, first=True)
        return True

    def close(self) -> None:
        self.receiver.close()

    def metrics(self) -> dict[str, float]:
        """Room failures, and the local prefill policy's calibrated costs (per-path
        request and token counts are the server's, from each request's usage)."""
        rooms = {
            "pd_failed_rooms": self.table.num_zombified,
            "pd_zombie_rooms": self.table.count(RoomState.ZOMBIE),
        }
        return rooms | self.restores.metrics() | self.policy.metrics()

    # -- integrity (engine/invariants.py aggregates it) ---------------------------------

    def held_requests(self) -> list[tuple[str, Request]]:
        return (
            [("decode_queued", r) for r in self.queue]
            + [("decode_rooms", r) for r in self.rooms.values()]
            + [("decode_restoring", r) for r in self.restoring.values()]
        )

    def page_holders(self) -> list[Request]:
        """Rooms' requests and zombie stand-ins (queued requests hold no pages yet)."""
        return [*self.rooms.values(), *self.zombies.values(), *self.restoring.values()]

    def ended_holders(self) -> dict[str, Request]:
        return {f"zombie room {room}": stand_in for room, stand_in in self.zombies.items()}

    @property
    def counts(self) -> dict[str, int]:
        table = self.table
        return {
            "decode_queued": table.num_queued,
            "decode_rooms": table.count(RoomState.PREALLOCATED) + table.count(RoomState.SENT),
            "decode_restoring": table.count(RoomState.RESTORING),
            "zombie_rooms": table.count(RoomState.ZOMBIE),
        }

    def check_integrity(self) -> list[str]:
        """The room table's own (rooms.py), and the L3 restores match their rooms."""
        awaited = self.table.requests_in(*_WAITING, RoomState.RESTORING)
        return self.table.check_integrity() + self.restores.check_integrity(awaited)

    def release_room(self, room_id: str) -> bool:
        """No write into the room's pages can happen any more: free them."""
        room = self.table.get(room_id)
        if room is None or room.state is not RoomState.ZOMBIE:
            return False
        self.kv.release(room.req)
        self.table.release(room_id)
        return True


def _sent(room: Room) -> SentRoom:
    assert room.task is not None, "a SENT room has its task"
    return SentRoom(room.rid, room.target, room.task, room.history)
