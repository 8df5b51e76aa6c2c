"""Runs a workload against a backend: conversations' rounds in order, starts paced by a
request rate (or the trace's arrival times), a concurrency cap, an optional round
barrier, and bounds on every request and on the whole run. One `RequestResult` per
request that was sent."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstrata.bench.client import Backend, Completion
from kvstrata.bench.workloads import Conversation, History, TextRenderer, Workload


@dataclass(frozen=True)
class Pacing:
    request_rate: float  # starts per second; 0: each request as soon as it is ready
    arrival: str  # "poisson" or "fixed" gaps at that rate
    max_concurrency: int  # 0: no limit
    round_barrier: bool
    seed: int


@dataclass(frozen=True)
class RequestResult:
    conversation: int  # agentic: the session's index
    group: int  # agentic: the agent kind
    round: int  # 0-based; agentic: the turn
    start_s: float  # since the run started
    prompt_tokens: int
    completion: Completion
    # agentic: the session's id, and for a resumed turn the pause (s, as sent) before it
    session_id: str | None = None
    pause_s: float | None = None


@dataclass(frozen=True)
class RunOutcome:
    results: list[RequestResult]  # in completion order
    duration_s: float
    timed_out: bool  # hit the time bound: requests in flight then were cancelled, not here


class _Run:
    """State of one run; lives on one event loop.

    Invariant: `outstanding[r]` = conversations still expected to finish round r (a
    conversation whose request fails stops there and leaves every later round's count)."""

    def __init__(
        self,
        workload: Workload,
        backend: Backend,
        pacing: Pacing,
        render: TextRenderer | None,
        on_result: Callable[[RequestResult], None],
    ) -> None:
        self.backend = backend
        self.pacing = pacing
        self.render = render
        self.on_result = on_result
        self.results: list[RequestResult] = []
        self.ready: asyncio.Queue[tuple[Conversation, int] | None] = asyncio.Queue()
        self.histories = {c.index: History(render) for c in workload.conversations}
        num_rounds = max((len(c.turns) for c in workload.conversations), default=0)
        self.outstanding = [
            sum(len(c.turns) > r for c in workload.conversations) for r in range(num_rounds)
        ]
        self.held: dict[int, list[Conversation]] = {}  # round -> waiting for the barrier
        self.num_left = workload.num_requests
        self.slots = asyncio.Semaphore(pacing.max_concurrency or max(1, self.num_left))
        self.rng = np.random.default_rng([pacing.seed, 7])
        self.tasks: set[asyncio.Task[None]] = set()
        self.start_s = time.perf_counter()
        self.workload = workload

    async def run(self) -> None:
        if self.num_left == 0:
            return
        for conversation in self.workload.conversations:
            if conversation.arrival_s is not None:
                self._spawn(self._at_arrival(conversation))
            else:
                self.ready.put_nowait((conversation, 0))
        while (item := await self.ready.get()) is not None:
            await self._pace()
            await self.slots.acquire()
            self._spawn(self._send(*item))
        await asyncio.gather(*self.tasks)

    def cancel(self) -> None:
        for task in self.tasks:
            task.cancel()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _pace(self) -> None:
        if self.pacing.request_rate <= 0:
            return
        gap_s = 1.0 / self.pacing.request_rate
        if self.pacing.arrival == "poisson":
            gap_s = float(self.rng.exponential(gap_s))
        await asyncio.sleep(gap_s)

    async def _at_arrival(self, conversation: Conversation) -> None:
        assert conversation.arrival_s is not None
        await asyncio.sleep(max(0.0, self.start_s + conversation.arrival_s - time.perf_counter()))
        await self.slots.acquire()
        await self._send(conversation, 0)

    async def _send(self, conversation: Conversation, round_index: int) -> None:
        """Send one round (a slot is held on entry and released here)."""
        try:
            turn = conversation.turns[round_index]
            history = self.histories[conversation.index]
            history.add_turn(turn.make_tokens())
            prompt = history.prompt()
            start_s = time.perf_counter() - self.start_s
            completion = await self.backend.send(prompt, turn.max_tokens)
        finally:
            self.slots.release()
        prompt_tokens = completion.num_prompt_tokens or history.num_tokens
        result = RequestResult(
            conversation.index, conversation.group, round_index, start_s, prompt_tokens, completion
        )
        self.results.append(result)
        self.on_result(result)
        history.add_answer(completion.output_ids, completion.text, completion.num_output_tokens)
        self._finish(conversation, round_index, completion.ok)

    def _finish(self, conversation: Conversation, round_index: int, ok: bool) -> None:
        num_rounds = len(conversation.turns)
        more = ok and round_index + 1 < num_rounds
        self.num_left -= 1 if more or ok else num_rounds - round_index
        if not more:  # it will never reach its later rounds
            for r in range(round_index + 1, num_rounds):
                self.outstanding[r] -= 1
        self.outstanding[round_index] -= 1
        if more and not self.pacing.round_barrier:
            self.ready.put_nowait((conversation, round_index + 1))
        elif more:
            self.held.setdefault(round_index + 1, []).append(conversation)
        if self.pacing.round_barrier and self.outstanding[round_index] == 0:
            for held in self.held.pop(round_index + 1, []):
                self.ready.put_nowait((held, round_index + 1))
        if self.num_left == 0:
            self.ready.put_nowait(None)


async def run_workload(
    workload: Workload,
    backend: Backend,
    pacing: Pacing,
    render: TextRenderer | None,
    max_duration_s: float,
    on_result: Callable[[RequestResult], None] = lambda r: None,
) -> RunOutcome:
    """Run `workload` to its end or for at most `max_duration_s`."""
    run = _Run(workload, backend, pacing, render, on_result)
    timed_out = False
    try:
        await asyncio.wait_for(run.run(), max_duration_s)
    except asyncio.TimeoutError:
        timed_out = True
        run.cancel()
        await asyncio.gather(*run.tasks, return_exceptions=True)
    return RunOutcome(run.results, time.perf_counter() - run.start_s, timed_out)
