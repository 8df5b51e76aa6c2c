"""`kvstrata bench --workload agentic`: runs the agent sessions of sim/agent_sessions.py
against a backend. Each root session starts at its start time, its turns follow their
pauses (divided by --agentic-time-scale), and every request carries its session's identity
in headers; a turn's sub-agents start from a copy of the parent's history, and the parent's
next turn waits for those it joins. One `RequestResult` per request sent."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from kvstrata.bench.client import Backend
from kvstrata.bench.runner import RequestResult, RunOutcome
from kvstrata.bench.trace import block_tokens
from kvstrata.bench.workloads import History, TextRenderer
from kvstrata.sim.agent_sessions import AgentSession, AgentTurn, AgentWorkload, Appended, Blocks

SESSION_HEADER = "X-Session-ID"
PARENT_HEADER = "X-Parent-Session-ID"
FINAL_HEADER = "X-Session-Final"


def session_headers(workload: AgentWorkload, session: AgentSession, turn: int) -> dict[str, str]:
    """The identity headers of `session`'s turn `turn` (final on its last)."""
    headers = {SESSION_HEADER: session.session_id}
    if session.parent is not None:
        headers[PARENT_HEADER] = workload.sessions[session.parent].session_id
    if turn == len(session.turns) - 1:
        headers[FINAL_HEADER] = "true"
    return headers


class AgentTokens:
    """The bench's token ids, in the server's vocabulary: each kind's prefix, each
    appended prompt, and each trace block (a function of its id, so shared blocks are
    shared prompts), all fixed by the seed."""

    def __init__(self, workload: AgentWorkload, vocab_size: int, seed: int) -> None:
        self.workload = workload
        self.vocab_size = vocab_size
        self.seed = seed
        self._blocks: dict[int, np.ndarray] = {}

    def prefix(self, kind: int) -> list[int]:
        length = self.workload.prefix_lens[kind] if kind < len(self.workload.prefix_lens) else 0
        return self._draw([41, kind], length)

    def appended(self, session: int, turn: int, num_tokens: int) -> list[int]:
        return self._draw([42, session, turn], num_tokens)

    def blocks(self, prompt: Blocks, session: int, turn: int) -> list[int]:
        """The trace prompt: its blocks' tokens cut to `input_len`, then fresh tokens for
        the tail the blocks do not name."""
        block_len = self.workload.block_len
        token_ids: list[int] = []
        for block_id in prompt.block_ids:
            block = self._blocks.get(block_id)
            if block is None:
                block = block_tokens(block_id, block_len, self.vocab_size, self.seed)
                self._blocks[block_id] = block
            token_ids.extend(block.tolist())
        del token_ids[prompt.input_len :]
        return token_ids + self._draw([43, session, turn], prompt.input_len - len(token_ids))

    def _draw(self, key: list[int], length: int) -> list[int]:
        rng = np.random.default_rng([self.seed, *key])
        return rng.integers(0, self.vocab_size, size=length).tolist()


def fit_to_context(workload: AgentWorkload, max_seq_len: int) -> tuple[AgentWorkload, int]:
    """Each session cut before its first turn whose prompt plus answer would not fit
    `max_seq_len` tokens (its last kept turn becomes final); sub-agents of cut turns go
    too. Returns the workload and the number of turns cut. Lengths count synthetic tokens
    (exact in token mode)."""
    kept: dict[int, list[AgentTurn]] = {}
    start_len: dict[int, int] = {}  # a sub-agent's context when spawned
    for session in workload.sessions:
        if session.parent is not None and session.index not in start_len:
            continue  # its spawning turn was cut
        if session.is_root and workload.prefix_lens:
            context_len = workload.prefix_lens[session.kind]
        else:
            context_len = start_len.get(session.index, 0)
        turns = []
        for turn in session.turns:
            if isinstance(turn.prompt, Appended):
                prompt_len = context_len + turn.prompt.num_tokens
            else:
                prompt_len = turn.prompt.input_len
            if prompt_len + turn.output_len >= max_seq_len:
                break
            context_len = prompt_len + turn.output_len
            start_len.update(dict.fromkeys(turn.children, context_len))
            turns.append(turn)
        if turns:
            kept[session.index] = turns
    new_index = {old: new for new, old in enumerate(kept)}
    sessions = []
    for old, turns in kept.items():
        session = workload.sessions[old]
        turns = [
            replace(t, children=tuple(new_index[c] for c in t.children if c in new_index))
            for t in turns
        ]
        parent = new_index[session.parent] if session.parent is not None else None
        sessions.append(replace(session, index=new_index[old], turns=tuple(turns), parent=parent))
    fitted = replace(workload, sessions=tuple(sessions))
    fitted.check()
    return fitted, workload.num_requests - fitted.num_requests


class AgentPrompts:
    """What each turn sends: token ids, or text through `render` (then a session's history
    keeps text, as the multiturn workload's does)."""

    def __init__(self, tokens: AgentTokens, render: TextRenderer | None) -> None:
        self.tokens = tokens
        self.render = render

    def root_history(self, kind: int) -> History:
        history = History(self.render)
        history.add_turn(self.tokens.prefix(kind))
        return history

    def prompt(
        self, session: AgentSession, index: int, turn: AgentTurn, history: History
    ) -> tuple[list[int] | str, int]:
        """The prompt and its synthetic token count. An appended turn extends the
        session's history; a trace turn is a prompt of its own."""
        if isinstance(turn.prompt, Appended):
            history.add_turn(self.tokens.appended(session.index, index, turn.prompt.num_tokens))
            return history.prompt(), history.num_tokens
        token_ids = self.tokens.blocks(turn.prompt, session.index, index)
        text = token_ids if self.render is None else self.render(token_ids)
        return text, len(token_ids)


@dataclass(frozen=True)
class AgentPacing:
    max_concurrency: int  # requests in flight at once (0: no limit)
    time_scale: float  # pauses and start times are divided by it
    max_duration_s: float  # the run stops after this long


class _AgentRun:
    """State of one run; lives on one event loop."""

    def __init__(
        self,
        workload: AgentWorkload,
        backend: Backend,
        prompts: AgentPrompts,
        pacing: AgentPacing,
        on_result: Callable[[RequestResult], None],
    ) -> None:
        self.workload = workload
        self.backend = backend
        self.prompts = prompts
        self.time_scale = pacing.time_scale
        self.on_result = on_result
        self.slots = asyncio.Semaphore(pacing.max_concurrency or max(1, workload.num_requests))
        self.results: list[RequestResult] = []
        self.tasks: set[asyncio.Task[None]] = set()
        self.start_s = time.perf_counter()

    async def run(self) -> None:
        for root in self.workload.roots:
            history = self.prompts.root_history(root.kind)
            self._spawn(self._session(root, history, root.start_s / self.time_scale))
        while self.tasks:  # sub-agents join the set while it runs
            await asyncio.gather(*list(self.tasks))

    def cancel(self) -> None:
        for task in self.tasks:
            task.cancel()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def _session(self, session: AgentSession, history: History, start_s: float) -> None:
        """Send the session's turns in order; after each, start the sub-agents it spawns
        and wait for those it joins. A failed turn ends the session there."""
        await asyncio.sleep(max(0.0, self.start_s + start_s - time.perf_counter()))
        last_end_s: float | None = None
        for index, turn in enumerate(session.turns):
            if index or not session.is_root:
                await asyncio.sleep(turn.pause_s / self.time_scale)
            prompt, num_tokens = self.prompts.prompt(session, index, turn, history)
            headers = session_headers(self.workload, session, index)
            async with self.slots:
                sent_s = time.perf_counter()
                completion = await self.backend.send(prompt, turn.output_len, headers)
            pause_s = sent_s - last_end_s if last_end_s is not None else None
            last_end_s = time.perf_counter()
            result = RequestResult(
                session.index,
                session.kind,
                index,
                sent_s - self.start_s,
                completion.num_prompt_tokens or num_tokens,
                completion,
                session.session_id,
                pause_s,
            )
            self.results.append(result)
            self.on_result(result)
            if not completion.ok:
                return
            history.add_answer(completion.output_ids, completion.text, completion.num_output_tokens)
            joined = []
            for child in (self.workload.sessions[c] for c in turn.children):
                task = self._spawn(self._session(child, history.copy(), 0.0))
                if child.joins_parent:
                    joined.append(task)
            await asyncio.gather(*joined)


async def run_agentic(
    workload: AgentWorkload,
    backend: Backend,
    prompts: AgentPrompts,
    pacing: AgentPacing,
    on_result: Callable[[RequestResult], None] = lambda r: None,
) -> RunOutcome:
    """Run every session to its end or for at most `pacing.max_duration_s`."""
    run = _AgentRun(workload, backend, prompts, pacing, on_result)
    timed_out = False
    try:
        await asyncio.wait_for(run.run(), pacing.max_duration_s)
    except asyncio.TimeoutError:
        timed_out = True
        run.cancel()
        await asyncio.gather(*run.tasks, return_exceptions=True)
    return RunOutcome(run.results, time.perf_counter() - run.start_s, timed_out)
