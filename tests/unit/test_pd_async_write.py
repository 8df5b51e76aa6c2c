"""A prefill rank's writes in flight (engine level, no HTTP): the engine keeps computing
other rooms while a write waits on its decode rank, the written request keeps its pages
until the write settles, and a failed write fails its room alone. The transport is the
real `ipc` one behind a gate the test opens, standing in for a slow or stopped peer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_pd_engine import GREEDY, assert_idle, make_pair, serve_pd, unified_outputs

from kvstrata.disagg.prefill import PrefillHandoff
from kvstrata.disagg.transport.base import KVSender, PendingWrite, TransferError
from kvstrata.engine.engine import Engine
from kvstrata.engine.invariants import check_engine


class _Gated:
    def __init__(self, gate: GatedSender, args: tuple[Any, ...]) -> None:
        self.gate, self.args = gate, args

    def poll(self) -> bool:
        if self.gate.failure is not None:
            raise TransferError(self.gate.failure)
        if not self.gate.open:
            return False
        self.gate.inner.write(*self.args)
        return True


class GatedSender(KVSender):
    """Writes through `inner` only once `open` (or fails them all with `failure`)."""

    def __init__(self, inner: KVSender) -> None:
        super().__init__(inner.pool)
        self.inner = inner
        self.open = False
        self.failure: str | None = None

    def write(self, endpoint: dict[str, Any], src: list[int], dst: list[int]) -> None:
        raise AssertionError("the prefill handoff starts writes; it never blocks on one")

    def start(self, endpoint: dict[str, Any], src: list[int], dst: list[int]) -> PendingWrite:
        return _Gated(self, (endpoint, src, dst))


def gated_prefill(prefill: Engine) -> tuple[PrefillHandoff, GatedSender]:
    handoff = prefill.role
    assert isinstance(handoff, PrefillHandoff)
    gate = GatedSender(handoff.sender)
    handoff.sender = gate
    return handoff, gate


def start_room(prefill: Engine, decode: Engine, prompt: list[int]) -> tuple[str, str]:
    """Decode rank preallocates; the prefill rank computes the prompt. Returns the decode
    and prefill request ids once the prefill request finished (its write started)."""
    req = decode.add_request(prompt, GREEDY)
    decode.step()
    (task,) = decode.role.take_tasks()
    p_req = prefill.role.add_prefill_task(task)
    while p_req.rid in prefill.requests:
        prefill.step()
    return req.rid, p_req.rid


def finish(decode: Engine, rid: str, first: Any) -> list[int]:
    out = decode.role.complete_transfer(first)
    while not out.finished:
        (out,) = [o for o in decode.step() if o.rid == rid]
    return out.output_ids


def test_the_engine_keeps_computing_while_a_write_waits(tiny_llama: Path) -> None:
    prefill, decode = make_pair(tiny_llama)
    handoff, gate = gated_prefill(prefill)
    prompts = [list(range(1, 30)), list(range(100, 141))]
    rid_a, p_rid_a = start_room(prefill, decode, prompts[0])
    (sending,) = handoff.sending.values()
    pages_a = list(sending.req.page_ids)
    assert pages_a and prefill.has_unfinished and not handoff.settled(p_rid_a).done()
    # A second room is computed meanwhile; the first one's pages stay held, not reused.
    rid_b, p_rid_b = start_room(prefill, decode, prompts[1])
    assert len(handoff.sending) == 2
    report = check_engine(prefill)
    assert report.ok, report.violations
    assert report.counts["prefill_sending"] == 2 and not report.idle
    assert sending.req.page_ids == pages_a
    for _ in range(3):
        prefill.step()
    assert not handoff.settled(p_rid_a).done()  # still in flight: nothing lands by itself
    gate.open = True
    prefill.step()
    assert handoff.settled(p_rid_a).done() and handoff.settled(p_rid_b).done()
    outputs = [
        finish(decode, rid_a, prefill.role.collect(p_rid_a)),
        finish(decode, rid_b, prefill.role.collect(p_rid_b)),
    ]
    assert outputs == unified_outputs(tiny_llama, prompts)
    assert check_engine(prefill).ok
    assert_idle(prefill)
    assert prefill.role.metrics()["pd_sent_writes"] == 2


def test_a_failed_write_fails_its_room_and_releases_its_pages(tiny_llama: Path) -> None:
    prefill, decode = make_pair(tiny_llama)
    handoff, gate = gated_prefill(prefill)
    rid, p_rid = start_room(prefill, decode, list(range(1, 30)))
    assert handoff.write_settled(next(iter(handoff.sending))) is handoff.rooms[p_rid].settled
    gate.failure = "decode rank stopped"
    prefill.step()
    assert handoff.settled(p_rid).done() and not handoff.sending
    with pytest.raises(TransferError, match="decode rank stopped"):
        prefill.role.collect(p_rid)
    assert_idle(prefill)
    assert check_engine(prefill).ok
    # The decode rank fails the room; both ranks keep serving.
    decode.abort(rid)
    assert decode.role.release_room(rid)
    assert_idle(decode)
    handoff.sender = gate.inner
    out = serve_pd(prefill, decode, list(range(1, 30)))
    assert out.output_ids == unified_outputs(tiny_llama, [list(range(1, 30))])[0]


def test_a_room_forgotten_while_writing_still_settles(tiny_llama: Path) -> None:
    """The server forgets a room whose client left; its write still ends before the pages
    go back, and an abort's wait (`write_settled`) covers it until then."""
    prefill, decode = make_pair(tiny_llama)
    handoff, gate = gated_prefill(prefill)
    rid, p_rid = start_room(prefill, decode, list(range(1, 30)))
    (room_id,) = handoff.sending
    handoff.forget(p_rid)
    waiter = handoff.write_settled(room_id)
    prefill.step()
    assert not waiter.done() and prefill.has_unfinished
    gate.open = True
    prefill.step()
    assert waiter.done() and handoff.write_settled(room_id).done()
    assert_idle(prefill)
    decode.abort(rid)
    assert decode.role.release_room(rid)
    assert_idle(decode)
