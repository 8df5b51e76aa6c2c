"""Decode side of PD disaggregation: after its prefix match a request either goes to this
rank's own scheduler (local prefill) or waits for pages (prealloc), then for its prompt
KV (transfer from the prefill rank, restore from L2/L3, the L3 part possibly beside the
transfer), then joins the running batch. The decode rank's role (engine/role.py): owned
by the engine thread; the server sends the tasks and reports results through its
commands (`take_dispatch`, `complete_transfer`, `requeue`, `fail_room`, `release_room`)."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass

from kvstrata.core import (
    Batch,
    ErrorKind,
    FinishReason,
    PrefillPath,
    Request,
    RequestOutput,
    TierMatch,
)
from kvstrata.disagg.local_prefill import LocalPrefillPolicy, NeverLocal
from kvstrata.disagg.prefill_costs import PrefillDemand
from kvstrata.disagg.protocol import (
    PrefillDispatch,
    PrefillResult,
    PrefillTask,
    RoomTask,
    TransferState,
)
from kvstrata.disagg.restore import L3Restores, RestoreOutcome, RestoreSpan, SerialRestore
from kvstrata.disagg.transport.base import KVReceiver, TransferError
from kvstrata.engine.kv_manager import RequestKV
from kvstrata.engine.role import EngineServices
from kvstrata.engine.scheduler import Scheduler


@dataclass(frozen=True)
class _RoomStart:
    """When a room's task went out and what it asked for: a completed room calibrates the
    remote path's costs."""

    sent_s: float
    kv_bytes: int
    prefix_len: int  # the task's: the KV this rank holds or is restoring, not sent


class DecodeHandoff:
    """Invariant: a request in `queue`, `rooms` or `restoring` is WAITING and in no
    scheduler queue; only `_join` makes it RUNNING, as it leaves them."""

    def __init__(
        self, kv: RequestKV, scheduler: Scheduler, receiver: KVReceiver,
        page_bytes: int, services: EngineServices, vocab_size: int,
        prealloc_timeout_s: float = 0.0,
        policy: LocalPrefillPolicy | None = None, restores: L3Restores | None = None,
    ) -> None:  # fmt: skip
        self.kv = kv
        self.services = services
        self.vocab_size = vocab_size
        self.scheduler = scheduler
        self.receiver = receiver
        self.prealloc_timeout_s = prealloc_timeout_s  # 0: queued requests wait forever
        self.page_bytes = page_bytes
        self.policy = policy if policy is not None else NeverLocal()
        self.restores = restores if restores is not None else SerialRestore()
        self.local_rids: list[str] = []  # sent to the scheduler; drained by the server
        self._room_starts: dict[str, _RoomStart] = {}
        self.page_size = kv.page_size
        self.queue: deque[Request] = deque()  # BOOTSTRAPPING: waiting for pages
        self.rooms: dict[str, Request] = {}  # by room id; WAITING / TRANSFERRING: task sent
        # Rooms whose transfer landed (the first token went out) while L3 pages their
        # task claimed are still on the way: they decode once those arrive.
        self.restoring: dict[str, Request] = {}
        self._room_of: dict[str, str] = {}  # request id -> its room, in `rooms`/`restoring`
        # Rooms a request already had and gave up (retried elsewhere or recomputed here):
        # each later room of a request gets an id of its own, so that a late write of an
        # earlier room's prefill rank can never land in the pages of a later one.
        self._num_attempts: dict[str, int] = {}
        self.tasks: list[RoomTask] = []  # ready to send; drained by the server
        # Rooms whose request is gone (or moved on) but whose prefill rank may still write
        # into their pages: a stand-in holding the pages (and the prefix lock) stays here
        # until `release_room` says no write can come.
        self.zombies: dict[str, Request] = {}
        self.num_failed_rooms = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.queue) + len(self.rooms) + len(self.restoring) + len(self.zombies)

    def state(self, rid: str) -> TransferState | None:
        if rid in self._room_of:
            return TransferState.WAITING
        if any(req.rid == rid for req in self.queue):
            return TransferState.BOOTSTRAPPING
        return None

    def add(self, req: Request) -> None:
        self.queue.append(req)

    def holds(self, req: Request) -> bool:
        return req.rid in self._room_of or req in self.queue

    def request_in(self, room: str) -> Request | None:
        """The request room `room` fills, while its task is out."""
        return self.rooms.get(room)

    def room_of(self, rid: str) -> str | None:
        return self._room_of.get(rid)

    def before_release(self, req: Request, reason: FinishReason) -> bool:
        return False

    def before_step(self) -> None:
        """Settle the L3 restores that finished. Choose each matched request's path;
        local ones go to the scheduler. Prealloc the remote ones: plan the whole queue in
        one pass (FIFO; a request that does not fit stops the pass), evict once for all of
        it, then attach and emit the tasks.

            [0, l1_len) L1 | [l1_len, match) from L2 | [match, claimed) L3 read in flight
            | [claimed, prompt_len) sent
        """
        for outcome in self.restores.poll():
            self._restored(outcome)
        if not self.queue:
            return  # most steps: nothing waits (and the sums below walk every request)
        plans: list[tuple[Request, TierMatch, RestoreSpan | None]] = []
        num_planned_pages = 0
        reserve = len(self.scheduler.running)  # room for running requests to grow
        num_local_tokens = self.scheduler.num_prefill_tokens_left
        for req in list(self.queue):
            span = None
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
                    self._go_local(req)
                    num_local_tokens += num_uncached
                    continue
                req.prefill_path = PrefillPath.REMOTE
            self.kv.tiers.lock(match)
            num_pages = self.kv.num_pages_for(req.prompt_len) - match.l1.num_pages
            if num_planned_pages + num_pages + reserve > self.kv.num_available_pages:
                self.kv.tiers.unlock(match)
                break
            num_planned_pages += num_pages
            plans.append((req, match, span))
        self.kv.make_free(num_planned_pages)
        for req, match, span in plans:
            self.kv.attach_locked(req, match, req.prompt_len)
            self.queue.remove(req)
            attempt = self._num_attempts.get(req.rid, 0)
            room = req.rid if attempt == 0 else f"{req.rid}.{attempt}"
            self.rooms[room] = req
            self._room_of[req.rid] = room
            claimed_len = match.prefix_len
            if span is not None:  # span.end_page >= the match's pages
                self.restores.begin(room, req, span)
                claimed_len = span.end_page * self.page_size
            task = self._task(room, req, claimed_len)
            self.tasks.append(RoomTask(req.rid, task))
            kv_bytes = len(task.dst_page_ids) * self.page_bytes
            self._room_starts[room] = _RoomStart(time.monotonic(), kv_bytes, claimed_len)

    def _go_local(self, req: Request) -> None:
        """The scheduler prefills `req` (matching again at admission: what a tier lost
        meanwhile is computed too) and samples its first token here."""
        self.queue.remove(req)
        req.prefill_path = PrefillPath.LOCAL
        self.scheduler.add(req)
        self.local_rids.append(req.rid)

    def observe_step(self, batch: Batch, step_s: float) -> None:
        """Calibrates the local path's costs: the step's prompt tokens (all but its
        decodes, one token each) against its time. Counted here, not in the stepper, so
        ranks of other roles pay nothing per step."""
        num_decodes = sum(1 for item in batch.items if item.num_new_tokens == 1 and item.samples)
        self.policy.observe_step(batch.num_tokens - num_decodes, step_s)

    @property
    def choices_share_prompt(self) -> bool:
        return False  # each choice gets its own room

    @property
    def max_local_prefill_tokens(self) -> int:
        scheduler = self.scheduler
        demand = PrefillDemand(0, scheduler.num_prefill_tokens_left, len(scheduler.running), 0)
        return self.policy.max_local_tokens(demand)

    def _task(self, room: str, req: Request, prefix_len: int) -> PrefillTask:
        first_page = prefix_len // self.page_size
        return PrefillTask(
            room=room,
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
        if not self.prealloc_timeout_s or not self.queue:
            return []
        oldest_ok_s = time.monotonic() - self.prealloc_timeout_s
        return [req for req in self.queue if req.arrival_s < oldest_ok_s]

    def take_dispatch(self) -> PrefillDispatch:
        """The rooms preallocated since the last call, to send out, and the requests this
        rank took to prefill itself."""
        dispatch = PrefillDispatch(self.tasks, self.local_rids)
        self.tasks, self.local_rids = [], []
        return dispatch

    def take_tasks(self) -> list[PrefillTask]:
        """`take_dispatch`'s rooms, for a caller that runs no dispatcher (the requests
        prefilled here need nothing from it)."""
        return self.take_dispatch().tasks

    def complete_transfer(self, result: PrefillResult) -> RequestOutput:
        """The room's KV arrived; the request starts decoding from the prefill rank's first
        token. Raises TransferError (the caller fails the room) if the handoff is
        inconsistent."""
        if not 0 <= result.first_token_id < self.vocab_size:
            raise TransferError(
                f"room {result.room}: first token id {result.first_token_id} is outside the "
                f"vocabulary [0, {self.vocab_size})"
            )
        waiting = self.rooms.get(result.room)
        record = result.first_token_logprobs
        if (
            waiting is not None
            and waiting.params.logprobs is not None
            and (record is None or record.token_id != result.first_token_id)
        ):
            raise TransferError(f"room {result.room}: no logprobs for the first token")
        req = self._complete(result)
        return self.services.commit_token(req, result.first_token_id, record)

    def fail_room(
        self, room: str, message: str, kind: ErrorKind = ErrorKind.UNAVAILABLE
    ) -> RequestOutput | None:
        """The room's transfer failed: its request ends with `message` (None if it is
        gone); `kind` FAILED if the request caused it. Its pages stay held until
        `release_room`."""
        req = self.rooms.get(room)
        return self.services.fail_request(req, message, kind) if req is not None else None

    def _complete(self, result: PrefillResult) -> Request:
        """The prefill rank wrote the suffix pages: the request's prompt KV is whole."""
        req = self.rooms.get(result.room)
        if req is None:
            raise TransferError(f"no room {result.room!r} is waiting for a transfer")
        start = self._room_starts[result.room]
        num_expected = self.kv.num_pages_for(req.prompt_len) - start.prefix_len // self.page_size
        if result.num_pages_written != num_expected:
            raise TransferError(
                f"room {result.room}: {result.num_pages_written} pages arrived, "
                f"{num_expected} expected"
            )
        del self.rooms[result.room]
        self._num_attempts.pop(req.rid, None)
        del self._room_starts[result.room]
        num_computed = req.prompt_len - result.prefill_cached_tokens
        self.policy.observe_room(
            req.prompt_len, num_computed, time.monotonic() - start.sent_s,
            result.prefill_s, result.send_s, start.kv_bytes,
        )  # fmt: skip
        req.num_transferred_tokens = req.prompt_len - start.prefix_len
        if self.restores.is_pending(result.room):
            self.restoring[result.room] = req  # its first token goes out now
            return req
        del self._room_of[req.rid]
        self._join(req, start.prefix_len)
        return req

    def _restored(self, outcome: RestoreOutcome) -> None:
        """A claimed L3 span settled; a request whose transfer already landed goes on."""
        req = self.restoring.pop(outcome.room, None)
        if req is not None:
            del self._room_of[req.rid]
            self._join(req, outcome.claimed_len)

    def _join(self, req: Request, claimed_len: int) -> None:
        """Both the transfer and any claimed L3 pages are in: decode, or, if some claimed
        pages never came, recompute from the first of them."""
        if req.num_computed_tokens == claimed_len:
            self.kv.mark_computed(req, req.prompt_len)
            self.scheduler.add_running(req)
            return
        # No write can land any more: the valid KV goes to the cache, the rest is freed,
        # and the scheduler recomputes from the hole as it does for a preempted request
        # (counted as one, so the usage keeps what the first attach found).
        self.restores.count_repair(req.prompt_len - req.num_computed_tokens)
        self.kv.release(req)
        self.scheduler.recompute(req)

    def drop(self, req: Request) -> None:
        """A request leaves before its KV arrived (abort or failure). Queued: forgotten at
        once. Task sent: its pages wait in `zombies` until `release_room`, because the
        prefill rank may still be writing into them. Transfer landed, L3 pages awaited:
        released at once (its valid KV, `num_computed_tokens`, goes to the cache)."""
        self._num_attempts.pop(req.rid, None)
        room = self._room_of.pop(req.rid, None)
        if room is not None:
            self.restores.forget(room)
        if room is not None and self.restoring.pop(room, None) is not None:
            self.kv.release(req)
        elif room is not None:
            self.zombies[room] = self.rooms.pop(room)
            self._room_starts.pop(room, None)
            self.num_failed_rooms += 1
        elif req in self.queue:
            self.queue.remove(req)
            self.kv.forget(req)

    def requeue_room(self, room: str, path: PrefillPath) -> bool:
        """Room `room` failed (its prefill rank is dead, frozen or wrote wrongly) and its
        request lives on: a stand-in keeps the room's pages as a zombie until no write can
        land, and the request starts again with no pages, on `path` (remote: a new room,
        ahead of the queue; local: this rank's scheduler). False if no such room."""
        req = self.rooms.pop(room, None)
        if req is None:
            return False
        del self._room_of[req.rid]
        self._room_starts.pop(room, None)
        self.restores.forget(room)
        self.num_failed_rooms += 1
        self.zombies[room] = self.kv.hand_over(req)  # the pages and the prefix lock
        req.prefill_path = path
        if path is PrefillPath.LOCAL:
            self._num_attempts.pop(req.rid, None)
            self.scheduler.add(req)
            self.local_rids.append(req.rid)
        else:
            self._num_attempts[req.rid] = self._num_attempts.get(req.rid, 0) + 1
            self.queue.appendleft(req)
        return True

    def close(self) -> None:
        self.receiver.close()

    def metrics(self) -> dict[str, float]:
        """Room failures, and the local prefill policy's calibrated costs (per-path
        request and token counts are the server's, from each request's usage)."""
        rooms = {"pd_failed_rooms": self.num_failed_rooms, "pd_zombie_rooms": len(self.zombies)}
        return rooms | self.restores.metrics() | self.policy.metrics()

    # -- integrity (server/invariants.py aggregates it) ---------------------------------

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
        return {
            "decode_queued": len(self.queue), "decode_rooms": len(self.rooms),
            "decode_restoring": len(self.restoring), "zombie_rooms": len(self.zombies),
        }  # fmt: skip

    def check_integrity(self) -> list[str]:
        """Each room's request maps back to it, no zombie's request is still in its room,
        queued requests hold nothing, and the L3 restores match their rooms."""
        violations = [
            f"decode room {room} holds request {req.rid}"
            for room, req in (self.rooms | self.restoring).items()
            if self._room_of.get(req.rid) != room
        ]
        violations += [
            f"zombie room {room} still has a live request"
            for room, stand_in in self.zombies.items()
            if self._room_of.get(stand_in.rid) == room
        ]
        violations += [
            f"decode_queued request {req.rid} holds pages or a lock"
            for req in self.queue
            if req.page_ids or req.cache_handle
        ]
        return violations + self.restores.check_integrity(self.rooms | self.restoring)

    def release_room(self, room: str) -> bool:
        """No write into the room's pages can happen any more: free them."""
        req = self.zombies.pop(room, None)
        if req is None:
            return False
        self.kv.release(req)
        return True
