"""The router's reading of a kv_events stream, exactly: a snapshot then deltas keep the
rank's digest copy; a seq gap, a delta from another version, an epoch change outside a
snapshot, a dropped stream or one that does not begin with a snapshot end the
subscription (StreamGap); a snapshot of a new epoch (the rank's cache was reset) clears
the digest copy and the prefixes routed there."""

from __future__ import annotations

import pytest

from kvstrata.http.kv_event_wire import EventKind, KvEvent
from kvstrata.kvcache.digest_wire import DigestDelta
from kvstrata.router.events import EventStreams, StreamGap, StreamSettings
from kvstrata.router.policy import RoutingRequest
from kvstrata.router.workers import WorkerRegistry

SEED = bytes(32)
PAGE, CHUNK = 4, 8
LOAD = {
    "rank": 0, "num_running_reqs": 1, "num_waiting_reqs": 0, "num_queued_tokens": 3,
    "num_free_pages": 90, "num_cached_pages": 10, "num_used_pages": 0, "num_total_pages": 100,
}  # fmt: skip
HASHES = RoutingRequest(list(range(1, 25))).boundary_hashes(SEED, PAGE, CHUNK)  # 3 chunks


def delta(epoch: str, version: int, base: int | None, added: tuple[bytes, ...]) -> DigestDelta:
    return DigestDelta(epoch, version, base, base is None, CHUNK, PAGE, added, (), (), SEED)


def event(kind: EventKind, seq: int, epoch: str, digest: DigestDelta | None = None) -> KvEvent:
    # Through the wire form, as the router reads it.
    return KvEvent.from_line(KvEvent(kind, seq, epoch, LOAD, digest).to_line())


def streams() -> tuple[EventStreams, WorkerRegistry]:
    registry = WorkerRegistry((), ("http://127.0.0.1:3001",), 2)
    settings = StreamSettings(CHUNK, heartbeat_s=1.0, reconnect_s=0.5, connect_timeout_s=1.0)
    return EventStreams(registry, None, settings), registry  # type: ignore[arg-type]


def test_snapshot_then_deltas_keep_the_copy_and_load() -> None:
    events, registry = streams()
    rank = registry.decode[0]
    last = events._apply(
        rank, None, event(EventKind.SNAPSHOT, 0, "e1", delta("e1", 3, None, HASHES[:1])), True
    )
    last = events._apply(
        rank, last, event(EventKind.DELTA, 1, "e1", delta("e1", 4, 3, HASHES[1:])), True
    )
    last = events._apply(rank, last, KvEvent(EventKind.HEARTBEAT, 1, "e1"), True)
    last = events._apply(rank, last, event(EventKind.LOAD, 2, "e1"), True)
    assert rank.events_live and rank.healthy and last.seq == 2
    assert rank.digest is not None and set(rank.digest.entries) == set(HASHES)
    assert (rank.digest.epoch, rank.digest.version) == ("e1", 4)
    assert rank.load is not None and rank.load.num_queued_tokens == 3


@pytest.mark.parametrize(
    "second, reason",
    [
        (event(EventKind.DELTA, 2, "e1", delta("e1", 4, 3, HASHES[1:])), "event 2 after 0"),
        (event(EventKind.DELTA, 1, "e1", delta("e1", 5, 4, HASHES[1:])), "does not start"),
        (event(EventKind.LOAD, 1, "e2"), "outside a snapshot"),
        (KvEvent(EventKind.DROPPED, 1, "e1"), "dropped"),
        (KvEvent(EventKind.HEARTBEAT, 3, "e1"), "heartbeat at seq 3"),
    ],
)
def test_a_gap_ends_the_subscription(second: KvEvent, reason: str) -> None:
    events, registry = streams()
    rank = registry.decode[0]
    first = events._apply(
        rank, None, event(EventKind.SNAPSHOT, 0, "e1", delta("e1", 3, None, ())), True
    )
    with pytest.raises(StreamGap, match=reason):
        events._apply(rank, first, second, True)


def test_a_stream_must_begin_with_a_snapshot() -> None:
    events, registry = streams()
    with pytest.raises(StreamGap, match="began with a delta"):
        events._apply(
            registry.decode[0], None, event(EventKind.DELTA, 0, "e1", delta("e1", 4, 3, ())), True
        )


def test_a_new_epoch_clears_the_copy_and_the_routed_prefixes() -> None:
    events, registry = streams()
    rank = registry.decode[0]
    last = events._apply(
        rank, None, event(EventKind.SNAPSHOT, 0, "e1", delta("e1", 3, None, HASHES)), True
    )
    routed = registry.begin_request(rank, 24, HASHES)
    assert rank.routed.counts and rank.view().routed_prefixes
    # A flush: the rank's next event is a snapshot of a new, empty epoch.
    events._apply(rank, last, event(EventKind.SNAPSHOT, 1, "e2", delta("e2", 0, None, ())), True)
    assert rank.digest is not None and rank.digest.entries == {} and rank.digest.epoch == "e2"
    assert rank.routed.counts == {}
    registry.end_request(rank, routed)  # a request routed before the reset ends cleanly
    assert rank.num_inflight == 0 and rank.routed.counts == {}


def test_a_quiet_stream_counts_earlier_decisions_as_seen_by_the_rank() -> None:
    events, registry = streams()
    rank = registry.decode[0]
    last = events._apply(
        rank, None, event(EventKind.SNAPSHOT, 0, "e1", delta("e1", 3, None, ())), True
    )
    registry.begin_request(rank, 24, (), num_new_tokens=24)
    # The next event may predate the request's arrival: it still counts as unseen.
    last = events._apply(rank, last, event(EventKind.LOAD, 1, "e1"), True)
    assert rank.view().num_routed_since_poll == 1
    assert rank.view().num_routed_new_tokens_since_poll == 24
    # Quiet since (a heartbeat, or SETTLE_S without events): the load holds it.
    events._apply(rank, last, KvEvent(EventKind.HEARTBEAT, 1, "e1"), True)
    assert rank.view().num_routed_since_poll == 0
    assert rank.view().num_routed_new_tokens_since_poll == 0
    assert rank.view().num_unprefilled_tokens == 24  # the router's own lower bound stays
