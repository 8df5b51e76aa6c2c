"""Slow is not dead: a poll of a real (stand-in) rank that times out counts as a failure
only when the rank's /health fails too. A busy prefill rank (its /get_load held by a long
step, its /health answered at once) stays healthy and keeps getting requests."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx
from stand_in_rank import LOAD, StandInRank

from kvstrata.router.policy import RankLoad
from kvstrata.router.workers import LoadInquirer, RankState, Role, WorkerRegistry

POLL_TIMEOUT_S = 0.2  # a hung request never answers, so any timeout gives the same result
FAILURES = 2  # unhealthy_after_failures
NUM_POLLS = FAILURES + 2


def poll_prefill_rank(rank: StandInRank, between_polls: Callable[[int], None]) -> RankState:
    """One prefill rank (and no decode rank) polled once while it answers, then NUM_POLLS
    times with `between_polls(i)` called before poll i; its record at the end."""

    async def run() -> RankState:
        registry = WorkerRegistry((rank.url,), (), FAILURES)
        async with httpx.AsyncClient() as client:
            inquirer = LoadInquirer(registry, client, 0.0, POLL_TIMEOUT_S)
            await inquirer.poll_once()
            assert registry.prefill[0].healthy
            for i in range(NUM_POLLS):
                between_polls(i)
                await inquirer.poll_once()
        return registry.prefill[0]

    return asyncio.run(run())


def test_a_rank_slow_to_answer_get_load_but_answering_health_stays_healthy() -> None:
    with StandInRank() as rank:
        state = poll_prefill_rank(rank, lambda i: rank.hang.add("/get_load"))
        assert rank.count("/health") == NUM_POLLS
    assert state.healthy
    assert state.view().healthy  # policies still route to it: requests wait there
    assert (state.num_consecutive_failures, state.num_consecutive_slow_polls) == (0, NUM_POLLS)
    assert state.load == RankLoad.from_json(LOAD)  # the last answer's load is kept
    assert state.last_error is None


def test_a_rank_that_answers_again_is_no_longer_slow() -> None:
    def slow_then_fast(i: int) -> None:
        if i == 0:
            rank.hang.add("/get_load")
        if i == NUM_POLLS - 1:
            rank.hang.clear()
            rank.release()

    with StandInRank() as rank:
        state = poll_prefill_rank(rank, slow_then_fast)
    assert state.healthy
    assert (state.num_consecutive_failures, state.num_consecutive_slow_polls) == (0, 0)


def test_a_rank_whose_health_hangs_too_goes_unhealthy() -> None:
    with StandInRank() as rank:
        state = poll_prefill_rank(rank, lambda i: rank.hang.update({"/get_load", "/health"}))
    assert not state.healthy
    assert state.role is Role.PREFILL
    assert state.num_consecutive_failures == NUM_POLLS
    assert state.num_consecutive_slow_polls == 0
    assert state.last_error is not None
    assert "ReadTimeout" in state.last_error and "/health: ReadTimeout" in state.last_error


def test_a_rank_whose_health_says_503_goes_unhealthy() -> None:
    def engine_failed(i: int) -> None:
        rank.hang.add("/get_load")
        rank.health_status = 503

    with StandInRank() as rank:
        state = poll_prefill_rank(rank, engine_failed)
    assert not state.healthy
    assert state.last_error is not None and state.last_error.endswith("/health: answered 503")


def test_a_dead_rank_goes_unhealthy_without_a_health_check() -> None:
    with StandInRank() as rank:
        url = rank.url
    # Nothing listens on the port any more: connection refused, not a timeout.
    registry = WorkerRegistry((url,), (), FAILURES)
    registry.on_poll_ok(
        registry.prefill[0], RankLoad.from_json(LOAD), registry.poll_mark(registry.prefill[0])
    )

    async def run() -> None:
        async with httpx.AsyncClient() as client:
            inquirer = LoadInquirer(registry, client, 0.0, POLL_TIMEOUT_S)
            for _ in range(FAILURES):
                await inquirer.poll_once()

    asyncio.run(run())
    state = registry.prefill[0]
    assert not state.healthy and state.num_consecutive_failures == FAILURES
    assert state.last_error is not None and "/health" not in state.last_error
