"""Both ends of PD rooms in a rank's server, each the event loop's typed handle on its
role (run on the engine thread through `EngineLoop.run`). `PrefillRooms`: the prefill
rank's table of rooms in progress and rooms aborted. `PrefillDispatcher`: the decode
rank's sender of preallocated rooms, which frees a failed or abandoned room's pages only
once no write can still land in them, gives up on a prefill rank that stops answering
(prefill_watch.py) and prefills here a request no prefill rank was named for."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Coroutine
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import httpx

from kvstrata.core import ErrorKind, PrefillPath
from kvstrata.disagg.decode import DecodeHandoff
from kvstrata.disagg.prefill import PrefillHandoff
from kvstrata.disagg.protocol import PrefillDispatch, PrefillResult, PrefillTask, RoomTask
from kvstrata.disagg.transport.base import TransferError
from kvstrata.errors_text import describe_error
from kvstrata.http.middleware import CLUSTER_KEY_HEADER
from kvstrata.pd.failures import (
    Attempts,
    FailurePolicy,
    PrefillRankError,
    PrefillUnresponsive,
    failure_cause,
)
from kvstrata.pd.prefill_watch import PrefillWatch, Watched
from kvstrata.runtime.engine_loop import EngineLoop
from kvstrata.runtime.request_group import EngineUnavailable, RequestGroup

logger = logging.getLogger("kvstrata.pd")
_MAX_TOMBSTONES = 100_000


@dataclass(frozen=True)
class ActiveRoom:
    """A room a prefill rank is computing: the engine request and its HTTP call's group."""

    rid: str
    group: RequestGroup


class PrefillRooms:
    """Prefill side: rooms in progress and rooms aborted before they arrived. A room
    aborted first is refused when its task arrives late, so an abort acknowledgement is a
    promise that no write will ever come. `role` is None on a rank of another mode (its
    /pd/abort has no write to wait for)."""

    def __init__(self, engine_loop: EngineLoop, role: PrefillHandoff | None) -> None:
        self.engine_loop = engine_loop
        self.role = role
        self.active: dict[str, ActiveRoom] = {}  # by room id
        self.aborted: OrderedDict[str, None] = OrderedDict()

    def tombstone(self, room: str) -> None:
        self.aborted[room] = None
        while len(self.aborted) > _MAX_TOMBSTONES:
            self.aborted.popitem(last=False)

    @property
    def counts(self) -> dict[str, int]:
        return {"prefill_rooms_http": len(self.active)}

    def submit(self, rid: str, task: PrefillTask) -> RequestGroup:
        """Queue the room as engine request `rid`; raises EngineUnavailable."""
        assert self.role is not None, "a prefill rank's route"
        return self.engine_loop.submit_prefill(rid, task, self.role.add_prefill_task)

    async def wait_settled(self, rid: str) -> None:
        """Until the room of request `rid` has its outcome (the write landed or failed)."""
        assert self.role is not None, "a prefill rank's route"
        await asyncio.wrap_future(await self.engine_loop.run(self.role.settled, rid))

    async def collect(self, rid: str) -> PrefillResult:
        """The settled room's result (once); raises TransferError if it failed."""
        assert self.role is not None, "a prefill rank's route"
        return await self.engine_loop.run(self.role.collect, rid)

    async def forget(self, rid: str) -> None:
        """Drop a room nobody will collect."""
        if self.role is not None:
            await self.engine_loop.run(self.role.forget, rid)

    async def wait_write_settled(self, room: str) -> None:
        """Until no write into room `room` is in flight. Once the engine thread ran this,
        it has processed every abort queued before (a write starts only on that thread)."""
        if self.role is not None:
            settled: Future[None] = await self.engine_loop.run(self.role.write_settled, room)
            await asyncio.wrap_future(settled)


class PrefillDispatcher:
    """Decode side. Lives on the event loop; the engine thread hands it preallocated
    rooms and the requests it prefills itself (`on_dispatch`); it reports back through
    the role's commands (`EngineLoop.run`). A room that fails goes to `failures`: a new
    room elsewhere, this rank's own prefill, or the request fails with every path it
    tried. The engine loop's hooks (`after_step`, `on_abort`)."""

    def __init__(
        self, engine_loop: EngineLoop, role: DecodeHandoff, timeout_s: float,
        api_key: str | None = None, failures: FailurePolicy | None = None,
        cluster_key: str | None = None, answer_timeout_s: float = 10.0,
    ) -> None:  # fmt: skip
        self.engine_loop = engine_loop
        self.role = role
        self.timeout_s = timeout_s
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        if cluster_key is not None:  # prefill ranks serve /pd/* only to holders of it
            headers[CLUSTER_KEY_HEADER] = cluster_key
        # A connection that is not taken up in `answer_timeout_s` is a rank gone or frozen;
        # an answer may take up to `timeout_s` while the rank keeps answering its /health.
        timeout = httpx.Timeout(timeout_s, connect=min(answer_timeout_s, timeout_s))
        self._client = httpx.AsyncClient(headers=headers, timeout=timeout)
        self.watch = PrefillWatch(self._client, answer_timeout_s)
        self.failures = failures if failures is not None else FailurePolicy("fail", ())
        self.targets: dict[str, str] = {}  # rid -> prefill URL of its next room
        self._attempts: dict[str, Attempts] = {}  # rid -> its failed rooms, while it lives
        self._active: dict[str, str] = {}  # rid -> its room in flight
        self._inflight: dict[str, asyncio.Task[None]] = {}  # room -> its run or settling
        self._cancelled: set[str] = set()  # rids cancelled before their room went out
        self._settling: set[str] = set()  # rooms whose `_run` took its cancellation
        self.num_failed_rooms = 0
        self.num_local_without_prefill = 0  # requests prefilled here: no prefill rank named

    @property
    def counts(self) -> dict[str, int]:
        return {"dispatcher_targets": len(self.targets), "dispatcher_active": len(self._active)}

    def after_step(self) -> None:
        """Engine thread: hand the rooms of the last step to the event loop."""
        self.engine_loop.post(self.on_dispatch, self.role.take_dispatch())

    def on_abort(self, rids: list[str]) -> None:
        self.cancel(rids)

    def on_tasks(self, tasks: list[PrefillTask]) -> None:
        self.on_dispatch(PrefillDispatch([RoomTask(task.room, task) for task in tasks], []))

    def on_dispatch(self, dispatch: PrefillDispatch) -> None:
        for rid in dispatch.local_rids:  # prefilled on this rank: no prefill rank needed
            self.targets.pop(rid, None)
            self._attempts.pop(rid, None)
            self._cancelled.discard(rid)
        for rid, task in dispatch.room_tasks:
            url = self.targets.pop(rid, None)
            if rid in self._cancelled:
                self._cancelled.discard(rid)
                self._attempts.pop(rid, None)
                self._spawn(task.room, self._release(task.room))
            elif url is None:  # no prefill rank was there to name: this rank prefills
                self._spawn(task.room, self._prefill_here(task.room))
            else:
                self._active[rid] = task.room
                self._spawn(task.room, self._run(rid, url, task), url, rid)

    async def _prefill_here(self, room: str) -> None:
        """No prefill rank ever saw `room`: its request goes to this rank's own prefill and
        its pages are free at once (nothing can write into them)."""
        self.num_local_without_prefill += 1
        with contextlib.suppress(EngineUnavailable):
            await self._requeue(room, PrefillPath.LOCAL)
        await self._release(room)

    def cancel(self, rids: list[str]) -> None:
        """Requests went away (client disconnect or abort): stop their rooms."""
        for rid in rids:
            self.targets.pop(rid, None)
            self._attempts.pop(rid, None)
            room = self._active.get(rid)
            task = self._inflight.get(room) if room is not None else None
            if task is not None:
                task.cancel()
            else:
                self._cancelled.add(rid)

    def _spawn(
        self, room: str, work: Coroutine[Any, Any, None], url: str | None = None,
        rid: str | None = None,
    ) -> None:  # fmt: skip
        task = asyncio.ensure_future(work)
        self._inflight[room] = task

        def done(finished: asyncio.Task[None]) -> None:
            self._inflight.pop(room, None)
            if url is not None and finished.cancelled() and room not in self._settling:
                # Cancelled before `_run` began: no handler of its ran (not its `finally`
                # either), so the room (a zombie once the engine aborts it) still needs
                # settling, and its request's entry in `_active` removing.
                if rid is not None and self._active.get(rid) == room:
                    del self._active[rid]
                self._spawn(room, self._settle(url, room, None))
            self._settling.discard(room)

        task.add_done_callback(done)

    async def _run(self, rid: str, url: str, task: PrefillTask) -> None:
        try:
            async with self.watch.watching(url) as watched:
                result = await self._send_room(url, task, watched)
            await self.engine_loop.run_output(self.role.complete_transfer, result)
            self._attempts.pop(rid, None)
        except asyncio.CancelledError:
            self._settling.add(task.room)
            await asyncio.shield(self._settle(url, task.room, None))
            raise
        except (httpx.HTTPError, TransferError, ValueError, TypeError) as e:
            self.num_failed_rooms += 1
            await self._recover(rid, url, task.room, failure_cause(e), describe_error(e))
        finally:
            if self._active.get(rid) == task.room:
                del self._active[rid]

    async def _send_room(self, url: str, task: PrefillTask, watched: Watched) -> PrefillResult:
        """POST the room; raises PrefillUnresponsive if `url` stops answering first."""
        post = asyncio.ensure_future(self._client.post(f"{url}/pd/prefill", json=task.to_json()))
        silent = asyncio.ensure_future(watched.unresponsive.wait())
        try:
            done, _ = await asyncio.wait({post, silent}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            silent.cancel()
            if not post.done():
                post.cancel()
                await asyncio.gather(post, return_exceptions=True)
        if post not in done:
            raise PrefillUnresponsive(watched.why)
        response = post.result()
        if response.status_code != 200:
            raise PrefillRankError(url, response.status_code, response.text, _error_code(response))
        return PrefillResult.from_json(response.json())

    async def _recover(self, rid: str, url: str, room: str, cause: str, why: str) -> None:
        """Room `room` of request `rid` failed: start its next path, then settle the room
        (its pages wait for the prefill rank's promise not to write)."""
        attempts = self._attempts.setdefault(rid, Attempts())
        attempts.urls.append(url)
        attempts.reasons.append(why)
        logger.warning("room %s: prefill on %s failed (%s): %s", room, url, cause, why)
        outcome, message = "failed", None
        next_url = self.failures.next_url(attempts, cause)
        with contextlib.suppress(EngineUnavailable):
            if next_url is not None:
                # Set before the engine can hand the new room out: on_dispatch may run as
                # soon as this coroutine yields.
                self.targets[rid] = next_url
                if await self._requeue(room, PrefillPath.REMOTE):
                    outcome = "retried"
                else:
                    self.targets.pop(rid, None)
            may_recompute = outcome == "failed" and self.failures.may_recompute(cause)
            if may_recompute and await self._requeue(room, PrefillPath.LOCAL):
                outcome = "recomputed"
        # An error the request caused on the prefill rank is its own: it fails, not retried.
        kind = ErrorKind.FAILED if cause == "request_error" else ErrorKind.UNAVAILABLE
        if cause == "request_error":
            message = (f"prefill rank {url} failed on this request ({why}); not retried, as "
                       "the request may be what broke it")  # fmt: skip
        elif outcome == "failed":
            message = self.failures.give_up_message(attempts)
        if outcome != "retried":
            self._attempts.pop(rid, None)
        self.failures.count(cause, outcome)
        await self._settle(url, room, message, kind)

    async def _requeue(self, room: str, path: PrefillPath) -> bool:
        return await self.engine_loop.run(self.role.requeue_room, room, path)

    async def _settle(
        self, url: str, room: str, message: str | None, kind: ErrorKind = ErrorKind.UNAVAILABLE
    ) -> None:
        """Fail the request now (if `message`); free its pages once the prefill rank
        promised not to write (or cannot: it is gone)."""
        if message is not None:
            with contextlib.suppress(EngineUnavailable):
                await self.engine_loop.run_output(self.role.fail_room, room, message, kind)
        await self._abort_remote(url, room)
        await self._release(room)

    async def _abort_remote(self, url: str, room: str) -> None:
        delay_s = 0.1
        while True:
            try:
                response = await self._client.post(f"{url}/pd/abort", json={"room": room})
                if response.status_code == 200:
                    return
                if response.status_code in (400, 422):
                    # It refuses the room id itself, so it never accepted a task of it.
                    logger.warning("room %s: %s refused the abort: %s", room, url, response.text)
                    return
            except httpx.ConnectError:
                return  # nothing listens there any more: no write can come
            except httpx.HTTPError:
                pass
            logger.warning("room %s: prefill rank %s has not confirmed the abort", room, url)
            await asyncio.sleep(delay_s)
            delay_s = min(delay_s * 2, 5.0)

    async def _release(self, room: str) -> None:
        with contextlib.suppress(EngineUnavailable):
            await self.engine_loop.run(self.role.release_room, room)

    async def close(self) -> None:
        for task in list(self._inflight.values()):
            task.cancel()
        await asyncio.gather(*self._inflight.values(), return_exceptions=True)
        await self.watch.close()
        await self._client.aclose()


def _error_code(response: httpx.Response) -> str | None:
    """The `error.code` of an OpenAI-shaped error body, if it is one."""
    try:
        error = response.json().get("error")
    except (ValueError, AttributeError):
        return None
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) else None
