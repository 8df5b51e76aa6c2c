"""The decode rank's `RoomTable` (disagg/rooms.py) with hand-built requests and tasks: the
exact states of every path a room takes (joined, restored, given up and released, local,
withdrawn, retried under a new id), the refusal of every transition its state does not
lead to (the table unchanged), and `check_integrity` naming each corruption of it."""

from __future__ import annotations

import pytest

from kvstrata.core import Request, SamplingParams
from kvstrata.disagg.protocol import PrefillTask
from kvstrata.disagg.rooms import (
    Attempts,
    IllegalTransition,
    Room,
    RoomState,
    RoomTable,
)

PAGE = 4
S = RoomState


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        self.now_s += 1.0
        return self.now_s


def request(rid: str, num_tokens: int = 10) -> Request:
    return Request(rid, list(range(num_tokens)), SamplingParams(max_tokens=4))


def attach(room: Room, claimed_len: int = PAGE, first_page_id: int = 0) -> PrefillTask:
    """Give the room's request its pages (as the KV manager's attach does) and the task
    asking for those past `claimed_len`."""
    req = room.req
    num_pages = -(-req.prompt_len // PAGE)
    req.page_ids = list(range(first_page_id, first_page_id + num_pages))
    dst = req.page_ids[claimed_len // PAGE :]
    return PrefillTask(room.room_id, req.prompt_ids, claimed_len, dst, {"backend": "ipc"})


def table() -> RoomTable:
    return RoomTable(PAGE, clock=Clock())


def states(rooms: RoomTable) -> dict[str, RoomState]:
    return {room_id: rooms.get(room_id).state for room_id in list(rooms._rooms)}  # type: ignore[union-attr]


def test_a_room_goes_queued_preallocated_sent_landed_joined() -> None:
    rooms = table()
    room = rooms.queue(request("a"))
    assert (room.room_id, room.state, room.attempt, room.target) == ("a", S.QUEUED, 0, None)
    assert rooms.aim("a", "http://p0").target == "http://p0"
    assert [r.room_id for r in rooms.queued()] == ["a"] and rooms.check_integrity() == []
    task = attach(room)
    assert rooms.preallocate("a", task, kv_bytes=3 * 64).state is S.PREALLOCATED
    assert (room.claimed_len, room.page_ids, room.kv_bytes) == (4, [1, 2], 192)
    assert rooms.queued() == [] and rooms.check_integrity() == []
    assert rooms.hand_out() == [room] and room.state is S.SENT and rooms.hand_out() == []
    assert rooms.land("a").state is S.LANDED
    assert rooms.join("a").state is S.JOINED
    assert len(rooms) == 0 and rooms.room_of("a") is None and rooms.check_integrity() == []
    assert (room.queued_s, room.preallocated_s, room.sent_s, room.landed_s) == (1, 2, 3, 4)


def test_a_landed_room_waits_for_its_l3_pages_then_joins() -> None:
    rooms = table()
    room = rooms.queue(request("a"))
    rooms.preallocate("a", attach(room, claimed_len=8), 0)
    rooms.hand_out()
    rooms.land("a")
    assert rooms.await_restore("a").state is S.RESTORING
    assert rooms.requests_in(S.RESTORING) == {"a": room.req} and rooms.check_integrity() == []
    assert rooms.join("a").state is S.JOINED and len(rooms) == 0


def test_a_failed_room_is_a_zombie_until_released_and_its_retry_has_a_new_id() -> None:
    rooms = table()
    req = request("a")
    first = rooms.queue(req, "http://p0")
    rooms.preallocate("a", attach(first), 0)
    rooms.hand_out()
    stand_in = Request("a", req.prompt_ids, req.params, page_ids=list(req.page_ids))
    assert rooms.zombify("a", stand_in).state is S.ZOMBIE and first.req is stand_in
    assert rooms.room_of("a") is None and rooms.num_zombified == 1
    req.page_ids = []  # handed over
    history = first.history.then("http://p0", "refused")
    second = rooms.queue(req, "http://p1", history, first=True)
    assert (second.room_id, second.attempt, second.history.urls) == ("a.1", 1, ("http://p0",))
    assert rooms.room_of("a") is second and rooms.check_integrity() == []
    assert states(rooms) == {"a": S.ZOMBIE, "a.1": S.QUEUED}
    assert rooms.release("a").state is S.FAILED
    assert states(rooms) == {"a.1": S.QUEUED} and rooms.check_integrity() == []


def test_a_retry_goes_first_and_local_or_withdrawn_rooms_leave() -> None:
    rooms = table()
    for rid in ("a", "b"):
        rooms.queue(request(rid))
    rooms.queue(request("c"), history=Attempts(("u",), ("x",)), first=True)
    assert [r.room_id for r in rooms.queued()] == ["c.1", "a", "b"]
    assert rooms.go_local("a").state is S.LOCAL
    assert rooms.withdraw("b").state is S.FAILED
    assert [r.room_id for r in rooms.queued()] == ["c.1"] and rooms.check_integrity() == []
    room = rooms.queue(request("d"))
    rooms.preallocate("d", attach(room), 0)
    assert rooms.withdraw("d").state is S.FAILED  # never handed out: nobody can write
    assert rooms.hand_out() == [] and rooms.count(S.PREALLOCATED) == 0


def test_every_transition_its_state_does_not_lead_to_is_refused() -> None:
    rooms = table()
    queued = rooms.queue(request("q"))
    sent = rooms.queue(request("s"))
    rooms.preallocate("s", attach(sent), 0)
    rooms.hand_out()
    zombie = rooms.queue(request("z"))
    rooms.preallocate("z", attach(zombie, first_page_id=10), 0)
    rooms.hand_out()
    rooms.zombify("z", zombie.req)
    before = states(rooms)
    refused = [
        lambda: rooms.queue(request("q")),  # a second live room of one request
        lambda: rooms.land("q"),  # QUEUED -> LANDED: nothing was sent
        lambda: rooms.join("q"),
        lambda: rooms.zombify("q", queued.req),  # no prefill rank can write: no zombie
        lambda: rooms.release("q"),
        lambda: rooms.await_restore("s"),  # SENT -> RESTORING: it has not landed
        lambda: rooms.join("s"),
        lambda: rooms.withdraw("s"),  # SENT: a write may still come
        lambda: rooms.go_local("s"),
        lambda: rooms.aim("s", "http://p1"),
        lambda: rooms.preallocate("s", attach(sent), 0),
        lambda: rooms.land("z"),  # a zombie's late write is no transfer
        lambda: rooms.withdraw("z"),
        lambda: rooms.zombify("z", zombie.req),
        lambda: rooms.release("nobody"),
    ]
    for transition in refused:
        with pytest.raises(IllegalTransition):
            transition()
    assert states(rooms) == before and rooms.check_integrity() == []
    assert rooms.num_zombified == 1


def test_check_integrity_names_each_corruption() -> None:
    rooms = table()
    queued = rooms.queue(request("q"))
    sent = rooms.queue(request("s"))
    rooms.preallocate("s", attach(sent), 0)
    rooms.hand_out()
    assert rooms.check_integrity() == []

    def broken() -> str:
        violations = rooms.check_integrity()
        assert violations
        return "; ".join(violations)

    queued.state = S.SENT  # moved without its transition: the queue index disagrees
    assert "the queue is not the queued rooms" in broken()
    queued.state = S.QUEUED
    queued.req.page_ids = [7]
    assert "queued room q holds pages" in broken()
    queued.req.page_ids = []
    sent.req.page_ids[1] = 99  # the task writes a page the request no longer holds
    assert "room s's task writes pages the room does not hold" in broken()
    sent.req.page_ids[1] = 1
    sent.state = S.LANDED  # transient: never seen between two steps
    assert "room s is landed but still in the table" in broken()
    sent.state = S.ZOMBIE  # a zombie the request -> room index still points at
    assert "the request -> room index" in broken()
    sent.state = S.SENT
    sent.req = request("other")
    assert "room s of s holds request other" in broken()
    sent.req = request("s")
    sent.req.page_ids = [0, 1, 2]
    assert rooms.check_integrity() == []
