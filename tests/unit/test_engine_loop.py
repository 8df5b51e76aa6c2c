"""EngineLoop against a scripted fake engine: outputs reach their groups, closing a group
aborts its requests, flush refuses while busy or waits for idle, stop aborts what is in
flight, an admission failure fails its group alone, and an engine failure fails the running
requests with EngineFailed (the rest with EngineUnavailable) and calls `on_fatal`. A gate
lets the test decide exactly when each engine step happens, so nothing here depends on
timing."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from kvstrata.core import CacheUsage, FinishReason, RequestOutput, SamplingParams
from kvstrata.engine.load import EngineLoad
from kvstrata.runtime.engine_loop import EngineLoop, EngineUnavailable, RequestRejected
from kvstrata.runtime.request_group import EngineFailed, RequestFailed

TIMEOUT_S = 30


class FakeEngine:
    """Each step gives every request one token (its position), finishing at max_tokens.
    With `gated`, every step first waits for one `release()`."""

    def __init__(self, gated: bool = False) -> None:
        self.requests: dict[str, tuple[list[int], SamplingParams, list[int]]] = {}
        self.aborted: list[str] = []
        self.num_flushes = 0
        self.fail_steps = False
        self.made_progress = False
        self.closed = False
        self.not_running: set[str] = set()  # requests `running_rids` leaves out (queued)
        self._gate = threading.Semaphore(0) if gated else None

    def release(self, steps: int = 1) -> None:
        assert self._gate is not None
        for _ in range(steps):
            self._gate.release()

    def bind_thread(self) -> None:
        pass  # no device

    def watch_workers(self, on_lost: Callable[[Exception], None]) -> None:
        self.on_lost = on_lost  # a tensor-parallel engine calls it once a worker exits

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise ValueError("the prompt is empty")

    def add_request(self, prompt_ids: list[int], params: SamplingParams, rid: str) -> None:
        self.requests[rid] = (prompt_ids, params, [])

    def running_rids(self) -> list[str]:
        return [rid for rid in self.requests if rid not in self.not_running]

    def add_choices(self, prompt_ids: list[int], params: SamplingParams, rids: list[str]) -> None:
        if prompt_ids == [666]:
            raise RuntimeError("admission broke")
        for rid in rids:  # the loop queues each prompt's choices together (params.n of them)
            self.add_request(prompt_ids, params, rid)

    def step(self) -> list[RequestOutput]:
        if self._gate is not None:
            self._gate.acquire()
        if self.fail_steps:
            raise RuntimeError("boom")
        outputs = []
        self.made_progress = bool(self.requests)
        for rid, (prompt, params, out_ids) in list(self.requests.items()):
            out_ids.append(len(out_ids))
            done = len(out_ids) == params.max_tokens
            if done:
                del self.requests[rid]
            outputs.append(_output(rid, prompt, out_ids, FinishReason.LENGTH if done else None))
        return outputs

    def abort(self, rid: str) -> RequestOutput | None:
        if rid not in self.requests:
            return None
        prompt, _, out_ids = self.requests.pop(rid)
        self.aborted.append(rid)
        return _output(rid, prompt, out_ids, FinishReason.ABORT, new=False)

    def flush_cache(self) -> bool:
        if self.requests:
            return False
        self.num_flushes += 1
        return True

    def load(self) -> EngineLoad:
        return EngineLoad(len(self.requests), 0, 0, 10, 0, 10)

    def close(self) -> None:
        self.closed = True


def _output(
    rid: str, prompt: list[int], out_ids: list[int], reason: FinishReason | None, new: bool = True
) -> RequestOutput:
    return RequestOutput(
        rid=rid, prompt_ids=prompt, output_ids=list(out_ids),
        new_token_ids=out_ids[-1:] if new else [], text="", finished=reason is not None,
        finish_reason=reason, cache_usage=CacheUsage(l1_tokens=len(prompt)),
    )  # fmt: skip


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S))


async def queued(coro: Coroutine[Any, Any, Any]) -> asyncio.Future[Any]:
    """Start an EngineLoop call and let it queue its command before the test goes on (the
    engine thread may be parked in a gated step; it must find the command when it wakes)."""
    task = asyncio.ensure_future(coro)
    await asyncio.sleep(0)
    return task


def test_outputs_reach_their_groups_in_prompt_order() -> None:
    async def main() -> None:
        engine = FakeEngine()
        loop = EngineLoop(engine)  # type: ignore[arg-type]
        loop.start()
        two = loop.submit("a", [[1, 2], [3]], SamplingParams(max_tokens=3))
        one = loop.submit("b", [[4]], SamplingParams(max_tokens=2))
        outs_two = await two.final_outputs()
        outs_one = await one.final_outputs()
        assert [o.rid for o in outs_two] == ["a-0", "a-1"]
        assert [o.output_ids for o in outs_two] == [[0, 1, 2], [0, 1, 2]]
        assert [o.rid for o in outs_one] == ["b-0"]
        assert outs_one[0].output_ids == [0, 1]
        assert all(o.finish_reason is FinishReason.LENGTH for o in outs_two + outs_one)
        await loop.stop()

    run(main())


def test_rejected_prompt_queues_nothing() -> None:
    async def main() -> None:
        engine = FakeEngine()
        loop = EngineLoop(engine)  # type: ignore[arg-type]
        loop.start()
        group = loop.submit("a", [[1], []], SamplingParams(max_tokens=2))
        with pytest.raises(RequestRejected, match="empty"):
            await group.final_outputs()
        assert (await loop.load()).num_running_reqs == 0
        await loop.stop()

    run(main())


def test_closing_a_group_aborts_its_unfinished_requests() -> None:
    async def main() -> None:
        engine = FakeEngine(gated=True)
        loop = EngineLoop(engine)  # type: ignore[arg-type]
        loop.start()
        group = loop.submit("a", [[1], [2]], SamplingParams(max_tokens=100))
        engine.release()
        index, first = await anext(group)
        assert (index, first.output_ids) == (0, [0])
        group.close()
        engine.release()  # the step in progress ends; the abort is handled right after
        load = await loop.load()
        assert load.num_running_reqs == 0
        assert engine.aborted == ["a-0", "a-1"]
        await loop.stop()

    run(main())


def test_flush_refuses_while_busy_and_waits_for_idle() -> None:
    async def main() -> None:
        engine = FakeEngine(gated=True)
        loop = EngineLoop(engine)  # type: ignore[arg-type]
        loop.start()
        group = loop.submit("a", [[1]], SamplingParams(max_tokens=2))
        refused = await queued(loop.flush_cache(wait=False))
        engine.release()  # step 1 of 2: still busy when the flush is handled
        assert await refused is False
        waiting = await queued(loop.flush_cache(wait=True))
        engine.release()  # step 2: the request finishes, then the waiting flush runs
        assert await waiting is True
        assert engine.num_flushes == 1
        assert [o.output_ids for o in await group.final_outputs()] == [[0, 1]]
        await loop.stop()

    run(main())


def test_waiting_flush_runs_when_an_abort_leaves_the_engine_idle() -> None:
    async def main() -> None:
        engine = FakeEngine(gated=True)
        loop = EngineLoop(engine)  # type: ignore[arg-type]
        loop.start()
        group = loop.submit("a", [[1]], SamplingParams(max_tokens=100))
        engine.release()
        await anext(group)  # running; the engine thread now waits in its next step
        waiting = await queued(loop.flush_cache(wait=True))  # queued before the abort
        group.close()
        engine.release()  # the step ends; the flush waits, then the abort makes it idle
        assert await waiting is True
        assert engine.aborted == ["a-0"] and engine.num_flushes == 1
        await loop.stop()

    run(main())


def test_stop_aborts_in_flight_requests() -> None:
    async def main() -> None:
        engine = FakeEngine(gated=True)
        loop = EngineLoop(engine)  # type: ignore[arg-type]
        loop.start()
        group = loop.submit("a", [[1]], SamplingParams(max_tokens=100))
        stopping = await queued(loop.stop())
        engine.release()
        await stopping
        (out,) = await group.final_outputs()
        assert out.finish_reason is FinishReason.ABORT
        assert not loop.is_healthy
        with pytest.raises(EngineUnavailable):
            loop.submit("b", [[1]], SamplingParams())

    run(main())


def test_engine_failure_fails_requests_and_refuses_new_work() -> None:
    async def main() -> None:
        engine = FakeEngine(gated=True)
        loop = EngineLoop(engine)  # type: ignore[arg-type]
        fatal_calls: list[None] = []
        loop.on_fatal = lambda: fatal_calls.append(None)
        loop.start()
        running = loop.submit("a", [[1]], SamplingParams(max_tokens=4))
        engine.not_running.add("b-0")  # queued behind "a" when the step breaks
        queued_group = loop.submit("b", [[2]], SamplingParams(max_tokens=4))
        await asyncio.sleep(0)
        engine.fail_steps = True
        engine.release()
        with pytest.raises(EngineFailed, match="not retried"):
            await running.final_outputs()
        with pytest.raises(EngineUnavailable) as raised:
            await queued_group.final_outputs()
        assert not isinstance(raised.value, EngineFailed)  # retryable: another rank may serve it
        assert loop.failure is not None and not loop.is_healthy
        with pytest.raises(EngineUnavailable):
            loop.submit("c", [[1]], SamplingParams())
        with pytest.raises(EngineUnavailable):
            await loop.load()
        while not fatal_calls:  # posted by the engine thread after the groups' failures
            await asyncio.sleep(0.01)
        assert fatal_calls == [None]  # the rank is told to end (kvstrata serve exits)
        await loop.stop()
        assert engine.closed

    run(main())


def test_a_worker_lost_while_idle_ends_the_rank_at_once() -> None:
    """A tensor-parallel worker that exits while no step runs fails the engine then, from
    its watch thread: /health stops answering and the rank ends (its supervisor starts the
    whole rank again), rather than at the next request."""

    async def main() -> None:
        engine = FakeEngine()
        loop = EngineLoop(engine)  # type: ignore[arg-type]
        fatal_calls: list[None] = []
        loop.on_fatal = lambda: fatal_calls.append(None)
        loop.start()
        assert loop.is_healthy
        threading.Thread(target=engine.on_lost, args=(RuntimeError("worker tp1 exited"),)).start()
        while not fatal_calls:
            await asyncio.sleep(0.01)
        assert not loop.is_healthy and "worker tp1 exited" in (loop.failure or "")
        with pytest.raises(EngineUnavailable):
            loop.submit("a", [[1]], SamplingParams())
        await loop.stop()
        assert engine.closed

    run(main())


def test_an_admission_failure_fails_its_group_alone() -> None:
    async def main() -> None:
        engine = FakeEngine()
        loop = EngineLoop(engine)  # type: ignore[arg-type]
        loop.on_fatal = lambda: pytest.fail("one request's failure must not end the rank")
        loop.start()
        bad = loop.submit("bad", [[666]], SamplingParams(max_tokens=2))
        with pytest.raises(RequestFailed, match="admission broke"):
            await bad.final_outputs()
        good = loop.submit("good", [[1]], SamplingParams(max_tokens=2))
        (out,) = await good.final_outputs()
        assert out.output_ids == [0, 1] and loop.is_healthy
        await loop.stop()

    run(main())


def test_a_slow_reader_gets_outputs_merged_not_queued() -> None:
    # 1000 steps of prompt 1 and 3 of prompt 0 arrive before anyone reads: the group holds
    # one unread output per prompt, and the deltas still carry every token and character.
    from kvstrata.runtime.request_group import RequestGroup
    from kvstrata.server.state import deltas

    def output(rid: str, num_tokens: int, finished: bool) -> RequestOutput:
        ids = list(range(num_tokens))
        return RequestOutput(
            rid=rid, prompt_ids=[1], output_ids=ids, new_token_ids=ids[-1:],
            text="x" * num_tokens, finished=finished,
            finish_reason=FinishReason.LENGTH if finished else None, cache_usage=CacheUsage(),
        )  # fmt: skip

    async def main() -> list[tuple[int, list[int], str]]:
        group = RequestGroup(["a-0", "a-1"], None, lambda rids: None)
        for step in range(1, 1001):
            group._deliver(output("a-1", step, finished=step == 1000))
            if step <= 3:
                group._deliver(output("a-0", step, finished=step == 3))
        assert len(group._unread) == 2  # not 1003 queued outputs
        return [(d.index, d.token_ids, d.text) async for d in deltas(group)]

    got = asyncio.run(main())
    assert got == [(1, list(range(1000)), "x" * 1000), (0, [0, 1, 2], "xxx")]
