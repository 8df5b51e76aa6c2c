"""Where a decode room's transfer lands (`Landing`): the prefill rank's result checked
against its SENT room, the room LANDED, and its request joining the running batch once any
L3 span its task claimed has settled, or recomputing from the first page that never came."""

from __future__ import annotations

from kvstrata.core import Request
from kvstrata.disagg.local_prefill import LocalPrefillPolicy
from kvstrata.disagg.protocol import PrefillResult
from kvstrata.disagg.restore import L3Restores, RestoreOutcome
from kvstrata.disagg.rooms import Room, RoomState, RoomTable
from kvstrata.disagg.transport.base import TransferError
from kvstrata.engine.kv_manager import RequestKV
from kvstrata.engine.scheduler import Scheduler


class Landing:
    """DecodeHandoff's collaborator for its rooms' second half (SENT -> LANDED ->
    (RESTORING ->) JOINED). It keeps no state: the rooms are the RoomTable's, the claimed
    spans the L3Restores', the pages the RequestKV's; engine thread only."""

    def __init__(
        self,
        kv: RequestKV,
        scheduler: Scheduler,
        table: RoomTable,
        restores: L3Restores,
        policy: LocalPrefillPolicy,
    ) -> None:
        self.kv = kv
        self.scheduler = scheduler
        self.table = table
        self.restores = restores
        self.policy = policy  # calibrated with each landed room's times
        self.page_size = kv.page_size

    def land(self, result: PrefillResult) -> Request:
        """The room's KV arrived: returns its request, decoding (or waiting for claimed
        L3 pages) from the prefill rank's first token, which the caller commits. Raises
        TransferError (the caller fails the room) if the handoff is inconsistent."""
        room = self.table.get(result.room)
        if room is None or room.state is not RoomState.SENT:
            raise TransferError(f"no room {result.room!r} is waiting for a transfer")
        req, record = room.req, result.first_token_logprobs
        if req.params.logprobs is not None and (
            record is None or record.token_id != result.first_token_id
        ):
            raise TransferError(f"room {result.room}: no logprobs for the first token")
        self._land(room, result)
        return req

    def _land(self, room: Room, result: PrefillResult) -> None:
        """The prefill rank wrote the suffix pages: the request's prompt KV is whole."""
        req, first_page = room.req, room.claimed_len // self.page_size
        num_expected = self.kv.num_pages_for(req.prompt_len) - first_page
        if result.num_pages_written != num_expected:
            raise TransferError(
                f"room {result.room}: {result.num_pages_written} pages arrived, "
                f"{num_expected} expected"
            )
        self.table.land(room.room_id)
        assert room.preallocated_s is not None and room.landed_s is not None
        num_computed = req.prompt_len - result.prefill_cached_tokens
        self.policy.observe_room(
            req.prompt_len,
            num_computed,
            room.landed_s - room.preallocated_s,
            result.prefill_s,
            result.send_s,
            room.kv_bytes,
        )
        req.num_transferred_tokens = req.prompt_len - room.claimed_len
        if self.restores.is_pending(room.room_id):
            self.table.await_restore(room.room_id)  # its first token goes out now
            return
        self.table.join(room.room_id)
        self._join(req, room.claimed_len)

    def restored(self, outcome: RestoreOutcome) -> None:
        """A claimed L3 span settled; a request whose transfer already landed goes on."""
        room = self.table.get(outcome.room)
        if room is not None and room.state is RoomState.RESTORING:
            self.table.join(room.room_id)
            self._join(room.req, outcome.claimed_len)

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
