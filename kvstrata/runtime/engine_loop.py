"""The engine thread of a rank and the event loop's handle on it. Commands go in through
one thread-safe queue; each RequestOutput comes back on its RequestGroup's asyncio queue
via `loop.call_soon_threadsafe`. After `start()`, only the engine thread touches the Engine
(its `validate`, which reads construction-time facts only, excepted). A failure one request
caused fails that request; one the engine cannot pin on a request fails the step's
requests and ends the rank (`on_fatal`), which its supervisor starts again."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from kvstrata.core import ErrorKind, RequestOutput, SamplingParams
from kvstrata.disagg.protocol import PrefillTask
from kvstrata.runtime import loop_commands as cmd
from kvstrata.runtime.request_group import (
    EngineFailed,
    EngineUnavailable,
    GroupMetrics,
    RequestFailed,
    RequestGroup,
    RequestRejected,
)

if TYPE_CHECKING:
    from kvstrata.engine.engine import Engine
    from kvstrata.engine.load import EngineLoad

logger = logging.getLogger("kvstrata.server")
T = TypeVar("T")
P = ParamSpec("P")


# With requests in flight but nothing to compute (e.g. every request waits for a KV
# transfer), the engine thread sleeps on its queue this long instead of spinning.
_IDLE_WAIT_S = 0.002


class RoomFailed(EngineUnavailable):
    """A PD room failed (prefill rank gone, transfer failed); the request ended."""


class EngineLoop:
    def __init__(self, engine: Engine, metrics: GroupMetrics | None = None) -> None:
        self.engine = engine
        self._metrics = metrics
        self._commands: queue.SimpleQueue[cmd.Command] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # Event-loop side: may new requests be submitted / may commands still be sent?
        self._accepting = False
        self._stopping = False
        # Engine-thread state: the group of every unfinished rid, and flushes waiting for idle.
        self._groups: dict[str, RequestGroup] = {}
        self._flush_waiters: list[concurrent.futures.Future[bool]] = []
        self._stalled = False  # the last step had work but could not advance any of it
        self.failure: str | None = None  # set once by the engine thread if the engine raised
        # Runs on the event loop once the engine failed beyond one request (`kvstrata
        # serve` ends the process then); None: the loop refuses all work from then on.
        # Set before `start`.
        self.on_fatal: Callable[[], None] | None = None

    # -- event-loop side -----------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread; outputs are delivered to the running event loop."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kvstrata-engine", daemon=True)
        self._accepting = True
        self._thread.start()
        # A worker that exits while the rank is idle fails it now, not at the next step.
        self.engine.watch_workers(lambda error: self._commands.put(cmd.Fail(error)))

    @property
    def is_healthy(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.failure is None

    def submit(
        self,
        request_id: str,
        prompts: list[list[int]],
        params: SamplingParams,
        then: Callable[[list[str]], None] | None = None,
    ) -> RequestGroup:
        """Queue one request per prompt (rids `{request_id}-{index}`); close the group.
        `then(rids)` runs on the engine thread once they are all in the engine, before any
        step sees them (a decode rank's role learns where their rooms go)."""
        self._check_accepting()
        rids = [f"{request_id}-{i}" for i in range(len(prompts))]
        group = RequestGroup(rids, self._metrics, self._abort_later)
        self._commands.put(cmd.Add(group, prompts, params, then))
        return group

    def submit_prefill(
        self, rid: str, task: PrefillTask, add: Callable[[PrefillTask, str], object]
    ) -> RequestGroup:
        """Queue a PD prefill room as request `rid` through `add` (the prefill role's
        `add_prefill_task`, run on the engine thread); close the group when done."""
        self._check_accepting()
        group = RequestGroup([rid], self._metrics, self._abort_later)
        self._commands.put(cmd.AddPrefill(group, task, add))
        return group

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Run `fn(engine)` on the engine thread, after every command queued before it."""
        return await self.run(fn, self.engine)

    async def run(self, command: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run `command(*args, **kwargs)` (a role's command, e.g. `role.release_room`) on
        the engine thread, after every command queued before it; its result or error."""
        thunk = functools.partial(command, *args, **kwargs)
        return await self._ask(lambda reply: cmd.Call(thunk, reply))

    async def run_output(
        self, command: Callable[P, RequestOutput | None], *args: P.args, **kwargs: P.kwargs
    ) -> None:
        """`run` for a command that ends or advances a request (a transfer completed, a
        room failed): its output goes to the request's group."""

        def run_and_deliver() -> None:
            out = command(*args, **kwargs)
            self._deliver([out] if out is not None else [])

        await self._ask(lambda reply: cmd.Call(run_and_deliver, reply))

    def post(self, fn: Callable[..., None], *args: Any) -> None:
        """Any thread: run `fn(*args)` on the event loop."""
        self._post(fn, *args)

    def _abort_later(self, rids: list[str]) -> None:
        self._commands.put(cmd.Abort(rids))

    def abort_all(self) -> None:
        """Abort every request in flight and refuse new ones (the end of a shutdown grace)."""
        self._accepting = False
        self._commands.put(cmd.AbortAll())

    async def flush_cache(self, wait: bool) -> bool:
        """Drop the prefix cache. If requests are in flight: False, or with `wait`, flush
        as soon as the engine is idle."""
        return await self._ask(lambda reply: cmd.Flush(wait, reply))

    async def load(self) -> EngineLoad:
        return await self._ask(cmd.Load)

    async def stop(self) -> None:
        """Abort everything still in flight, end the engine thread and close the engine
        (its pool, transports and storage: the thread's last act). Idempotent."""
        if self._thread is None or not self._thread.is_alive():
            self.engine.close()  # never started, or already stopped: no thread touches it
            return
        self._accepting = False
        self._stopping = True  # nothing may be queued behind the stop: it would never run
        reply: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._commands.put(cmd.Stop(reply))
        await asyncio.wrap_future(reply)
        await asyncio.to_thread(self._thread.join)

    def _check_accepting(self) -> None:
        if not self._accepting or self._stopping or not self.is_healthy:
            raise EngineUnavailable(self.failure or "the engine is not accepting requests")

    async def _ask(self, make: Callable[[concurrent.futures.Future[Any]], cmd.Command]) -> Any:
        if self._stopping or not self.is_healthy:
            raise EngineUnavailable(self.failure or "the engine is stopped")
        reply: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._commands.put(make(reply))
        return await asyncio.wrap_future(reply)

    # -- engine thread -------------------------------------------------------------------

    def _run(self) -> None:
        self.engine.bind_thread()
        try:
            while not self._serve():
                pass
            return
        except Exception as e:
            self._fail_engine(e)
        while not self._refuse(self._commands.get()):
            pass  # until the stop: every command is refused

    def _fail_engine(self, error: Exception) -> None:
        """The engine raised where no single request can be blamed (a step's forward, a
        device-side assert, a bug): its state can no longer be trusted. The requests it was
        running fail with EngineFailed (not retried: one of them may be the cause), the
        rest with EngineUnavailable (retried elsewhere), and the rank ends."""
        blamed = sorted(set(self.engine.running_rids()) & set(self._groups))
        what = f"{type(error).__name__}: {error}"
        logger.critical(
            "the engine failed in a step running requests %s (%s); this rank stops so its "
            "supervisor starts it again",
            blamed or "(none)",
            what,
            exc_info=error,
        )
        self.failure = f"the engine failed ({what}); this rank is restarting"
        failed_groups = {id(self._groups[rid]) for rid in blamed}
        for group in {id(g): g for g in self._groups.values()}.values():
            if id(group) in failed_groups:
                message = (
                    f"the engine failed in a step running this request ({what}); it "
                    "was not retried, as it may be what broke the engine"
                )
                self._post(group._fail, EngineFailed(message))
            else:
                self._post(group._fail, EngineUnavailable(self.failure))
        self._groups.clear()
        for reply in self._flush_waiters:
            _fail_reply(reply, EngineUnavailable(self.failure))
        self._flush_waiters.clear()
        if self.on_fatal is not None:
            self._post(self.on_fatal)

    def _serve(self) -> bool:
        """Drain commands (blocking only when there is no work), run one step. True: stop."""
        idle = not self.engine.has_unfinished
        command: cmd.Command | None = self._commands.get() if idle else self._poll()
        if command is None and self._stalled:
            command = self._wait(_IDLE_WAIT_S)
        while command is not None:
            if self._handle(command):
                return True
            command = self._poll()
        self._stalled = False
        if self.engine.has_unfinished:
            outputs = self.engine.step()
            self._stalled = not outputs and not self.engine.made_progress
            self._deliver(outputs)
        # Idle now, by a step that finished the last request or by an abort: a flush that
        # waited for this moment runs before the thread blocks on the queue again.
        if self._flush_waiters and not self.engine.has_unfinished:
            self._answer_flush_waiters()
        return False

    def _answer_flush_waiters(self) -> None:
        flushed = self.engine.flush_cache()
        for reply in self._flush_waiters:
            _answer(reply, flushed)
        self._flush_waiters.clear()

    def _poll(self) -> cmd.Command | None:
        try:
            return self._commands.get_nowait()
        except queue.Empty:
            return None

    def _wait(self, timeout_s: float) -> cmd.Command | None:
        try:
            return self._commands.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def _handle(self, command: cmd.Command) -> bool:
        if isinstance(command, cmd.Add):
            self._add(command)
        elif isinstance(command, cmd.Abort):
            self._abort(command.rids)
        elif isinstance(command, cmd.AbortAll):
            self._abort(list(self._groups))
        elif isinstance(command, cmd.Flush):
            if not command.wait or not self.engine.has_unfinished:
                _answer(command.reply, self.engine.flush_cache())
            else:
                self._flush_waiters.append(command.reply)
        elif isinstance(command, cmd.Load):
            _answer(command.reply, self.engine.load())
        elif isinstance(command, cmd.AddPrefill):
            self._add_prefill(command)
        elif isinstance(command, cmd.Call):
            try:
                _answer(command.reply, command.fn())
            except Exception as e:  # the caller's error, raised where it awaits
                _fail_reply(command.reply, e)
        elif isinstance(command, cmd.Fail):
            raise command.error
        elif isinstance(command, cmd.Stop):
            self._abort(list(self._groups))
            self._answer_flush_waiters()
            self.engine.close()
            _answer(command.reply, None)
            return True
        return False

    def _add(self, command: cmd.Add) -> None:
        # All or nothing: a group whose prompt is refused queues none of its requests.
        try:
            for prompt_ids in command.prompts:
                self.engine.validate(prompt_ids, command.params)
        except ValueError as e:
            self._post(command.group._fail, RequestRejected(str(e)))
            return
        # `prompts` holds each prompt params.n times in a row: its choices.
        n, rids = command.params.n, command.group.rids
        for rid in rids:
            self._groups[rid] = command.group  # first, so an engine failure reaches the group
        try:
            for start in range(0, len(rids), n):
                prompt_ids, choice_rids = command.prompts[start], rids[start : start + n]
                self.engine.add_choices(prompt_ids, command.params, choice_rids)
            if command.then is not None:
                command.then(rids)
        except Exception as e:
            self._unadd(command.group, e)

    def _add_prefill(self, command: cmd.AddPrefill) -> None:
        (rid,) = command.group.rids
        try:
            self.engine.validate(command.task.token_ids, SamplingParams(max_tokens=1))
        except ValueError as e:
            self._post(command.group._fail, RequestRejected(str(e)))
            return
        self._groups[rid] = command.group
        try:
            command.add(command.task, rid)
        except Exception as e:
            self._unadd(command.group, e)

    def _unadd(self, group: RequestGroup, error: Exception) -> None:
        """Admitting `group` raised: abort what of it got in (it releases what it holds)
        and fail the group alone, a 400 for input the engine refused."""
        for rid in group.rids:
            self._groups.pop(rid, None)
            self.engine.abort(rid)
        if isinstance(error, ValueError):
            self._post(group._fail, RequestRejected(str(error)))
            return
        logger.exception("admitting request %s failed", group.rids[0], exc_info=error)
        message = f"admitting the request failed ({type(error).__name__}: {error})"
        self._post(group._fail, RequestFailed(message))

    def _abort(self, rids: list[str]) -> None:
        outputs = [out for rid in rids if (out := self.engine.abort(rid)) is not None]
        self._deliver(outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        routed = []
        for out in outputs:
            group = self._groups.get(out.rid)
            if group is None:
                continue
            if out.finished:
                del self._groups[out.rid]
            if out.error is not None:
                failed = out.error.kind is ErrorKind.FAILED
                error = RequestFailed if failed else RoomFailed
                self._post(group._fail, error(out.error.message))
                continue
            routed.append((group, out))
        if routed:
            self._post(_deliver_all, routed)

    def _refuse(self, command: cmd.Command) -> bool:
        """After an engine failure: refuse `command`; True once it is the stop."""
        error = EngineUnavailable(self.failure or "the engine failed")
        if isinstance(command, (cmd.Add, cmd.AddPrefill)):
            self._post(command.group._fail, error)
        elif isinstance(command, (cmd.Flush, cmd.Load, cmd.Call)):
            _fail_reply(command.reply, error)
        elif isinstance(command, cmd.Stop):
            try:  # transports and pool files; an engine that failed may fail here too
                self.engine.close()
            except Exception:
                logger.exception("closing the failed engine failed")
            _answer(command.reply, None)
            return True
        return False

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        # A closed event loop raises RuntimeError: then nobody is left to tell.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(fn, *args)


def _deliver_all(routed: list[tuple[RequestGroup, RequestOutput]]) -> None:
    # One event-loop callback per engine step, however many requests it advanced.
    for group, out in routed:
        group._deliver(out)


def _answer(reply: concurrent.futures.Future[Any], result: Any) -> None:
    # A waiter that was cancelled (its client left) has nobody to answer; the engine
    # thread must not die of it.
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        reply.set_result(result)


def _fail_reply(reply: concurrent.futures.Future[Any], error: BaseException) -> None:
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        reply.set_exception(error)
