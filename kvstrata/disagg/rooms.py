"""The decode rank's rooms: one `Room` record per PD handoff, all of them in one
`RoomTable` whose methods are the only transitions and whose `check_integrity` checks
them; owned by the engine thread. What a SENT room tells the event loop (`SentRoom`,
`RoomSink`), and the attempt history a request's rooms share (`Attempts`)."""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from kvstrata.core import Request
from kvstrata.disagg.protocol import PrefillTask


class RoomState(enum.Enum):
    """QUEUED -> PREALLOCATED -> SENT -> LANDED -> (RESTORING ->) JOINED. A SENT room whose
    request leaves or moves on is a ZOMBIE until no write can come, then FAILED; QUEUED,
    PREALLOCATED and RESTORING rooms, where no write can come, go straight to FAILED; a
    QUEUED room whose request this rank prefills goes to LOCAL."""

    QUEUED = "queued"  # waiting for pages: holds none, and no prefix lock
    PREALLOCATED = "preallocated"  # pages attached, task made, not handed out yet
    SENT = "sent"  # handed out: a prefill rank may write into its pages from now on
    LANDED = "landed"  # the transfer landed (within one command: RESTORING or JOINED next)
    RESTORING = "restoring"  # landed; L3 pages its task claimed are still being read
    JOINED = "joined"  # final: its request decodes in the scheduler
    LOCAL = "local"  # final: its request is prefilled by this rank, without pages from it
    ZOMBIE = "zombie"  # its request left or moved on; its pages wait for no write to come
    FAILED = "failed"  # final: ended without joining; its pages (if any) are freed


FINAL = frozenset({RoomState.JOINED, RoomState.LOCAL, RoomState.FAILED})
# Where each transition may start (the graph in RoomState's docstring).
_QUEUED = frozenset({RoomState.QUEUED})
_PREALLOCATED = frozenset({RoomState.PREALLOCATED})
_SENT = frozenset({RoomState.SENT})
_LANDED = frozenset({RoomState.LANDED})
_LANDED_OR_RESTORING = frozenset({RoomState.LANDED, RoomState.RESTORING})
_ZOMBIE = frozenset({RoomState.ZOMBIE})
_WITHDRAWABLE = frozenset({RoomState.QUEUED, RoomState.PREALLOCATED, RoomState.RESTORING})


class IllegalTransition(RuntimeError):
    """A room was asked to go where its state does not lead (a bug of the caller)."""


@dataclass(frozen=True)
class Attempts:
    """The rooms a request tried and gave up so far, each as its prefill rank's URL and
    why: the failure policy's history, and the count that names the request's next room."""

    urls: Sequence[str] = ()
    reasons: Sequence[str] = ()

    def __len__(self) -> int:
        return len(self.urls)

    def then(self, url: str, why: str) -> Attempts:
        """This history and one more failed room."""
        return Attempts((*self.urls, url), (*self.reasons, why))

    def summary(self) -> str:
        """Each attempt's reason, naming its prefill rank where the reason does not."""
        return "; then ".join(
            why if url in why else f"{why} (prefill rank {url})"
            for url, why in zip(self.urls, self.reasons)
        )


NO_ATTEMPTS = Attempts()


def room_name(rid: str, attempt: int) -> str:
    """Each room of a request has an id of its own, so that a late write of an earlier
    room's prefill rank can never land in the pages of a later one."""
    return rid if attempt == 0 else f"{rid}.{attempt}"


@dataclass
class Room:
    """One PD handoff of one request: where its KV comes from and where it stands.

    [0, claimed_len) this rank holds or restores | [claimed_len, prompt_len) sent
    """

    room_id: str
    rid: str
    # The request; once ZOMBIE, whatever holds the room's pages (the request that left,
    # or the stand-in a requeued request handed them to).
    req: Request
    target: str | None  # the prefill rank's URL; None: the caller sends it (in process)
    history: Attempts  # the request's earlier rooms that failed; len(history): attempt
    state: RoomState
    queued_s: float  # monotonic clock
    claimed_len: int = 0  # set with the task
    task: PrefillTask | None = None  # set when PREALLOCATED
    kv_bytes: int = 0  # of the pages the task asks for
    preallocated_s: float | None = None
    sent_s: float | None = None
    landed_s: float | None = None

    @property
    def attempt(self) -> int:
        return len(self.history)

    @property
    def page_ids(self) -> list[int]:
        """This rank's pages the prefill rank writes into (none before PREALLOCATED)."""
        return self.task.dst_page_ids if self.task is not None else []


class SentRoom(NamedTuple):
    """A room as the event loop's sender gets it once SENT (a copy: the Room stays the
    engine thread's)."""

    rid: str
    target: str | None
    task: PrefillTask
    history: Attempts

    @property
    def room_id(self) -> str:
        return self.task.room


class RoomSink(Protocol):
    """Where a decode rank's SENT rooms go (the event loop's sender). Called on the engine
    thread, and only when there is something to say: never once per step."""

    def rooms_sent(self, rooms: list[SentRoom]) -> None:
        """These rooms are SENT: post each task to its prefill rank."""
        ...

    def rooms_dropped(self, room_ids: list[str]) -> None:
        """The requests of these SENT rooms left (they are ZOMBIEs now): stop waiting for
        their prefill ranks, and settle them (abort there, then `release_room`)."""
        ...


@dataclass
class RoomTable:
    """Every live room of a decode rank by room id (ZOMBIEs included), and its indexes:
    each request's room that is not a ZOMBIE (at most one), the QUEUED rooms in the order
    they get pages (a retried room goes first) and the PREALLOCATED rooms in the order they
    were made. Only the transitions below change them; rooms in a final state leave."""

    page_size: int
    clock: Callable[[], float] = time.monotonic
    num_zombified: int = 0  # rooms that turned ZOMBIE: their transfer was given up
    _rooms: dict[str, Room] = field(default_factory=dict)
    _of_rid: dict[str, str] = field(default_factory=dict)
    _queued: deque[str] = field(default_factory=deque)
    _preallocated: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self._rooms)

    def get(self, room_id: str) -> Room | None:
        return self._rooms.get(room_id)

    def room_of(self, rid: str) -> Room | None:
        """Request `rid`'s room that is not a ZOMBIE, if it has one."""
        room_id = self._of_rid.get(rid)
        return self._rooms[room_id] if room_id is not None else None

    def queued(self) -> list[Room]:
        """The QUEUED rooms, first to get pages first."""
        return [self._rooms[room_id] for room_id in self._queued]

    @property
    def num_queued(self) -> int:
        return len(self._queued)

    def requests_in(self, *states: RoomState) -> dict[str, Request]:
        """Room id -> its request (a ZOMBIE's: its page holder), of rooms in `states`."""
        return {r.room_id: r.req for r in self._rooms.values() if r.state in states}

    def count(self, state: RoomState) -> int:
        if state is RoomState.QUEUED:
            return len(self._queued)
        return sum(1 for room in self._rooms.values() if room.state is state)

    # -- transitions ---------------------------------------------------------------------

    def queue(
        self,
        req: Request,
        target: str | None = None,
        history: Attempts = NO_ATTEMPTS,
        first: bool = False,
    ) -> Room:
        """A new QUEUED room for `req` (its attempt `len(history)`), last in the queue, or
        `first` (a retry: its request waited already)."""
        if req.rid in self._of_rid:
            raise IllegalTransition(f"request {req.rid} already has room {self._of_rid[req.rid]}")
        room_id = room_name(req.rid, len(history))
        if room_id in self._rooms:
            raise IllegalTransition(f"room {room_id} exists already")
        room = Room(room_id, req.rid, req, target, history, RoomState.QUEUED, self.clock())
        self._rooms[room_id] = room
        self._of_rid[req.rid] = room_id
        if first:
            self._queued.appendleft(room_id)
        else:
            self._queued.append(room_id)
        return room

    def aim(self, room_id: str, target: str) -> Room:
        """The prefill rank a QUEUED room's task will go to."""
        room = self._expect(room_id, RoomState.QUEUED, "be aimed")
        room.target = target
        return room

    def go_local(self, room_id: str) -> Room:
        """QUEUED -> LOCAL: this rank prefills the request itself."""
        return self._end(self._move(room_id, _QUEUED, RoomState.LOCAL))

    def preallocate(self, room_id: str, task: PrefillTask, kv_bytes: int) -> Room:
        """QUEUED -> PREALLOCATED: the request holds its pages; `task` asks for the rest."""
        room = self._move(room_id, _QUEUED, RoomState.PREALLOCATED)
        room.task, room.claimed_len, room.kv_bytes = task, task.prefix_len, kv_bytes
        room.preallocated_s = self.clock()
        self._preallocated.append(room_id)
        return room

    def hand_out(self) -> list[Room]:
        """Every PREALLOCATED room -> SENT, in the order they were made."""
        if not self._preallocated:
            return []
        rooms = [
            self._move(room_id, _PREALLOCATED, RoomState.SENT)
            for room_id in list(self._preallocated)
        ]
        now_s = self.clock()
        for room in rooms:
            room.sent_s = now_s
        return rooms

    def land(self, room_id: str) -> Room:
        """SENT -> LANDED: the prefill rank wrote the room's pages."""
        room = self._move(room_id, _SENT, RoomState.LANDED)
        room.landed_s = self.clock()
        return room

    def await_restore(self, room_id: str) -> Room:
        """LANDED -> RESTORING: L3 pages its task claimed are still on the way."""
        return self._move(room_id, _LANDED, RoomState.RESTORING)

    def join(self, room_id: str) -> Room:
        """LANDED or RESTORING -> JOINED: the request's prompt KV is all in."""
        return self._end(self._move(room_id, _LANDED_OR_RESTORING, RoomState.JOINED))

    def zombify(self, room_id: str, holder: Request) -> Room:
        """SENT -> ZOMBIE: the request left or moves on; `holder` keeps the pages (and the
        prefix lock) until `release`, since the prefill rank may still write into them."""
        room = self._move(room_id, _SENT, RoomState.ZOMBIE)
        room.req = holder
        del self._of_rid[room.rid]
        self.num_zombified += 1
        return room

    def withdraw(self, room_id: str) -> Room:
        """QUEUED, PREALLOCATED or RESTORING -> FAILED: the request left where no write can
        come (no task went out, or its transfer landed already)."""
        return self._end(self._move(room_id, _WITHDRAWABLE, RoomState.FAILED))

    def release(self, room_id: str) -> Room:
        """ZOMBIE -> FAILED: no write can land in its pages any more."""
        return self._end(self._move(room_id, _ZOMBIE, RoomState.FAILED))

    def _expect(self, room_id: str, state: RoomState, what: str) -> Room:
        room = self._rooms.get(room_id)
        if room is None or room.state is not state:
            now = "no room" if room is None else room.state.value
            raise IllegalTransition(f"room {room_id} cannot {what}: it is {now}")
        return room

    def _move(self, room_id: str, sources: frozenset[RoomState], state: RoomState) -> Room:
        """`room_id` from one of `sources` to `state` (each transition its own sources)."""
        room = self._rooms.get(room_id)
        if room is None:
            raise IllegalTransition(f"no room {room_id} to move to {state.value}")
        if room.state not in sources:
            raise IllegalTransition(
                f"room {room_id} cannot go from {room.state.value} to {state.value}"
            )
        if room.state is RoomState.QUEUED:
            self._queued.remove(room_id)
        elif room.state is RoomState.PREALLOCATED:
            self._preallocated.remove(room_id)
        room.state = state
        return room

    def _end(self, room: Room) -> Room:
        del self._rooms[room.room_id]
        if self._of_rid.get(room.rid) == room.room_id:
            del self._of_rid[room.rid]
        return room

    # -- integrity -----------------------------------------------------------------------

    def check_integrity(self) -> list[str]:
        """Between two engine steps: every room is where its state says (no final or
        LANDED room left, the indexes exactly its QUEUED, PREALLOCATED and non-ZOMBIE
        rooms), its id is its request's attempt, and its task writes only pages it holds."""
        violations: list[str] = []
        live: dict[str, list[str]] = {}
        for room_id, room in self._rooms.items():
            violations += self._check_room(room_id, room)
            if room.state is not RoomState.ZOMBIE:
                live.setdefault(room.rid, []).append(room_id)
        violations += [
            f"request {rid} has {len(ids)} live rooms: {sorted(ids)}"
            for rid, ids in live.items()
            if len(ids) > 1
        ]
        if self._of_rid != {rid: ids[0] for rid, ids in live.items()}:
            violations.append("the request -> room index is not the rooms that are not zombies")
        for name, index, state in (
            ("queue", list(self._queued), RoomState.QUEUED),
            ("prealloc list", self._preallocated, RoomState.PREALLOCATED),
        ):
            in_state = [r for r, room in self._rooms.items() if room.state is state]
            if len(set(index)) != len(index) or set(index) != set(in_state):
                violations.append(f"the {name} is not the {state.value} rooms")
        return violations

    def _check_room(self, room_id: str, room: Room) -> list[str]:
        violations = []
        if room.room_id != room_id or room_id != room_name(room.rid, room.attempt):
            violations.append(f"room {room_id} is named {room.room_id} (attempt {room.attempt})")
        if room.state in FINAL or room.state is RoomState.LANDED:
            violations.append(f"room {room_id} is {room.state.value} but still in the table")
        if room.state is not RoomState.ZOMBIE and room.req.rid != room.rid:
            violations.append(f"room {room_id} of {room.rid} holds request {room.req.rid}")
        if room.state is RoomState.QUEUED:
            if room.task is not None or room.req.page_ids or room.req.cache_handle:
                violations.append(f"queued room {room_id} holds pages, a lock or a task")
            return violations
        task = room.task
        if task is None or task.room != room_id or task.prefix_len != room.claimed_len:
            violations.append(f"room {room_id} has no task of its own")
            return violations
        first_page = room.claimed_len // self.page_size
        held = room.req.page_ids[first_page : first_page + len(task.dst_page_ids)]
        if room.claimed_len % self.page_size or held != task.dst_page_ids:
            violations.append(f"room {room_id}'s task writes pages the room does not hold")
        return violations
