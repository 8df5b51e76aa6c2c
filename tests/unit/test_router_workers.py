"""The registry's load estimate across a poll that races the router's own requests,
exactly: a conversation's turn keeps its rank when the polled count still holds requests
that ended since (the flaky e2e `test_dp_routing` turn-affinity failure), and the rank's
count of other clients' requests still counts."""

from __future__ import annotations

from kvstrata.kvcache.digest_wire import DigestDelta
from kvstrata.router.cache_aware import CacheAware
from kvstrata.router.policy import RankLoad, RoutingRequest
from kvstrata.router.workers import RankState, Role, RoutedRequest, WorkerRegistry

SEED = bytes(32)
PAGE, CHUNK = 4, 8
URLS = tuple(f"http://127.0.0.1:{3001 + i}" for i in range(3))
# Two conversations' first turns, 16 tokens each (two chunks), both cached on rank 1.
HISTORIES = (list(range(1, 17)), list(range(101, 117)))


def boundaries(tokens: list[int]) -> list[bytes]:
    return RoutingRequest(tokens).boundary_hashes(SEED, PAGE, CHUNK)


def load(num_running: int = 0) -> RankLoad:
    return RankLoad(num_running, 0, 0, 100, 0, 0, 100)


def cluster() -> WorkerRegistry:
    """3 decode ranks, polled once: rank 1's digest holds both conversations."""
    workers = WorkerRegistry((), URLS, 2)
    for rank in workers.decode:
        workers.on_poll_ok(rank, load(), workers.poll_mark(rank))
        held = [h for history in HISTORIES for h in boundaries(history)] if rank.index == 1 else []
        delta = DigestDelta("e", 1, None, True, CHUNK, PAGE, tuple(held), (), (), SEED)
        workers.on_digest(rank, delta)
    return workers


Placed = tuple[RankState, RoutedRequest, str]  # a request's rank, lease and branch


def route_turn(workers: WorkerRegistry, turn: int) -> list[Placed]:
    """Both conversations' `turn`-th follow-up (8 * turn new tokens each), cache-aware."""
    placed = []
    for history in HISTORIES:
        routing = RoutingRequest(history + [500 + turn] * 8 * turn)
        decision = CacheAware(max_extra_reqs=2).choose(routing, workers.views(Role.DECODE))
        rank = workers.decode[decision.index]
        num_tokens = routing.num_prompt_tokens
        hashes = routing.boundary_hashes(SEED, PAGE, CHUNK)
        num_new = num_tokens - decision.matched_tokens
        placed.append(
            (rank, workers.begin_request(rank, num_tokens, hashes, num_new), decision.branch)
        )
    return placed


def end_turn(workers: WorkerRegistry, placed: list[Placed]) -> None:
    for rank, routed, _ in placed:
        workers.end_request(rank, routed)


def assert_next_turn_stays_on_rank_1(workers: WorkerRegistry) -> None:
    """Rank 1 holds both conversations and nothing runs anywhere: neither follow-up may
    be overridden to an idle rank (as when rank 1 looked 2 requests busier than it was,
    so that the second follow-up saw it 3 ahead)."""
    placed = route_turn(workers, 2)
    assert [(rank.index, branch) for rank, _, branch in placed] == [(1, "match")] * 2


def test_a_turn_keeps_its_rank_when_the_poll_still_counts_ended_requests() -> None:
    workers = cluster()
    second = route_turn(workers, 1)
    assert [(rank.index, branch) for rank, _, branch in second] == [(1, "match")] * 2
    rank1 = workers.decode[1]
    # A poll goes out and rank 1 answers while both turns still run; then both end.
    mark = workers.poll_mark(rank1)
    workers.on_poll_ok(rank1, load(num_running=2), mark)
    end_turn(workers, second)
    assert_next_turn_stays_on_rank_1(workers)


def test_a_turn_keeps_its_rank_when_no_poll_answered_since_the_last_turn_ended() -> None:
    workers = cluster()
    end_turn(workers, route_turn(workers, 1))  # a slow poll: no answer since the decisions
    assert_next_turn_stays_on_rank_1(workers)


def test_requests_routed_while_a_poll_is_out_are_not_counted_twice() -> None:
    workers = cluster()
    rank1 = workers.decode[1]
    mark = workers.poll_mark(rank1)  # the poll goes out before the second turns
    second = route_turn(workers, 1)
    workers.on_poll_ok(rank1, load(num_running=2), mark)  # its answer counts them
    assert workers.views(Role.DECODE)[1].estimated_queued_reqs == 2
    end_turn(workers, second)
    assert_next_turn_stays_on_rank_1(workers)


def test_own_requests_in_flight_count_even_before_the_rank_counts_them() -> None:
    workers = cluster()
    rank0 = workers.decode[0]
    for _ in range(2):
        workers.begin_request(rank0, 10)
    # The poll went out after both decisions but the rank answered before it saw them.
    workers.on_poll_ok(rank0, load(num_running=0), workers.poll_mark(rank0))
    assert workers.views(Role.DECODE)[0].estimated_queued_reqs == 2


def test_requests_of_other_clients_still_count() -> None:
    workers = cluster()
    rank0 = workers.decode[0]
    routed = workers.begin_request(rank0, 10)
    mark = workers.poll_mark(rank0)
    workers.on_poll_ok(rank0, load(num_running=4), mark)  # 1 of ours, 3 of others
    assert workers.views(Role.DECODE)[0].estimated_queued_reqs == 4
    workers.end_request(rank0, routed)
    assert workers.views(Role.DECODE)[0].estimated_queued_reqs == 3
    workers.begin_request(rank0, 10)
    assert workers.views(Role.DECODE)[0].estimated_queued_reqs == 4
