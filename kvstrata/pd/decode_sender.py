"""`DecodeRoomSender`: the decode rank's sender of SENT rooms, on the event loop. It posts
each room's task to its prefill rank, reports the outcome through the role's commands
(run on the engine thread through `EngineLoop.run`), starts a failed room's next path
(failures.py), gives up on a prefill rank that stops answering (decode_watch.py), and
frees a failed or abandoned room's pages only once no write can still land in them.
Everything else about a room is the engine thread's `RoomTable` (disagg/rooms.py)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

import httpx

from kvstrata.core import ErrorKind, PrefillPath, SamplingParams
from kvstrata.disagg.decode import DecodeHandoff
from kvstrata.disagg.protocol import PrefillResult, PrefillTask
from kvstrata.disagg.rooms import SentRoom
from kvstrata.disagg.transport.base import TransferError
from kvstrata.errors_text import describe_error
from kvstrata.http.middleware import CLUSTER_KEY_HEADER
from kvstrata.http.tracing import NULL_SPAN, Span
from kvstrata.pd.decode_watch import DecodePeerWatch, Watched
from kvstrata.pd.failures import (
    FailurePolicy,
    PrefillRankError,
    PrefillUnresponsive,
    failure_cause,
)
from kvstrata.pd.room_trace import room_result_attributes, room_span
from kvstrata.runtime.engine_loop import EngineLoop
from kvstrata.runtime.request_group import EngineUnavailable, RequestGroup

logger = logging.getLogger("kvstrata.pd")


@dataclass
class _Flight:
    """What runs for one room: its send, then (or instead) its settling."""

    task: asyncio.Task[None]
    sending: bool = True  # False once its outcome is being settled


class DecodeRoomSender:
    """Decode end, on the event loop; its only state is room id -> the flight running it.
    The engine thread hands it SENT rooms and word of rooms whose request left (it is the
    role's `RoomSink`), each through one post to the event loop: an idle rank posts
    nothing. A room that fails goes to `failures`: a new room elsewhere, this rank's own
    prefill, or the request fails with every path it tried."""

    def __init__(
        self,
        engine_loop: EngineLoop,
        role: DecodeHandoff,
        timeout_s: float,
        api_key: str | None = None,
        failures: FailurePolicy | None = None,
        cluster_key: str | None = None,
        answer_timeout_s: float = 10.0,
    ) -> None:
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
        self.watch = DecodePeerWatch(self._client, answer_timeout_s)
        self.failures = failures if failures is not None else FailurePolicy("fail", ())
        self._flights: dict[str, _Flight] = {}  # by room id
        self._spans: dict[str, Span] = {}  # by request id: the span its rooms go under

    @property
    def counts(self) -> dict[str, int]:
        """Rooms out at a prefill rank, and rooms with a flight (sending or settling). The
        names are the /debug/invariants counts of the dispatcher this replaced."""
        num_sending = sum(1 for flight in self._flights.values() if flight.sending)
        return {"dispatcher_targets": num_sending, "dispatcher_active": len(self._flights)}

    def submit(
        self,
        request_id: str,
        prompts: list[list[int]],
        params: SamplingParams,
        prefill_url: str | None,
        span: Span = NULL_SPAN,
    ) -> RequestGroup:
        """Queue a generation whose rooms go to `prefill_url` (None: this rank prefills
        it); the engine thread learns the rank with the requests, before any step. Its
        rooms' calls are traced under `span` while the group is open."""
        url = prefill_url.rstrip("/") if prefill_url is not None else None
        aim = functools.partial(self.role.aim, url)
        group = self.engine_loop.submit(request_id, prompts, params, then=aim)
        self._spans.update(dict.fromkeys(group.rids, span))
        group.call_on_close(lambda: self._forget_spans(group.rids))
        return group

    def _forget_spans(self, rids: list[str]) -> None:
        for rid in rids:
            self._spans.pop(rid, None)

    # -- engine thread: the role's RoomSink ----------------------------------------------

    def rooms_sent(self, rooms: list[SentRoom]) -> None:
        self.engine_loop.post(self.send, rooms)

    def rooms_dropped(self, room_ids: list[str]) -> None:
        self.engine_loop.post(self.stop, room_ids)

    # -- event loop ----------------------------------------------------------------------

    def send(self, rooms: list[SentRoom]) -> None:
        """Start each room's flight: its task posted to its prefill rank."""
        for room in rooms:
            assert room.target is not None, "a request no rank was named for prefills here"
            self._start(room.room_id, self._fly(room), room.target)

    def stop(self, room_ids: list[str]) -> None:
        """The requests of these rooms left: stop waiting for their prefill ranks (the
        flight then settles the room). A flight settling already goes on."""
        for room_id in room_ids:
            flight = self._flights.get(room_id)
            if flight is not None and flight.sending:
                flight.task.cancel()

    def _start(
        self, room_id: str, work: Coroutine[Any, Any, None], url: str, sending: bool = True
    ) -> None:
        flight = _Flight(asyncio.ensure_future(work), sending)
        self._flights[room_id] = flight

        def done(finished: asyncio.Task[None]) -> None:
            if self._flights.get(room_id) is flight:
                del self._flights[room_id]
            if finished.cancelled() and flight.sending:
                # Cancelled before `_fly` began: no handler of its ran, so the room (a
                # zombie once its request left) still needs settling.
                self._start(room_id, self._settle(url, room_id, None), url, sending=False)

        flight.task.add_done_callback(done)

    def _settling(self, room_id: str) -> None:
        flight = self._flights.get(room_id)
        if flight is not None:
            flight.sending = False

    async def _fly(self, room: SentRoom) -> None:
        url, room_id = room.target, room.room_id
        assert url is not None
        try:
            result = await self._post_traced(url, room)
            await self.engine_loop.run_output(self.role.complete_transfer, result)
        except asyncio.CancelledError:
            self._settling(room_id)
            await asyncio.shield(self._settle(url, room_id, None))
            raise
        except (httpx.HTTPError, TransferError, ValueError, TypeError) as e:
            self._settling(room_id)
            await self._recover(room, url, failure_cause(e), describe_error(e))

    async def _post_traced(self, url: str, room: SentRoom) -> PrefillResult:
        """`_post_task` under the room's span (room_trace.py), which the prefill rank's
        spans go under."""
        span = room_span(self._spans.get(room.rid, NULL_SPAN), room)
        try:
            async with self.watch.watching(url) as watched:
                result = await self._post_task(url, room.task, watched, span.headers())
            span.set(room_result_attributes(result))
            return result
        except (httpx.HTTPError, TransferError, ValueError, TypeError) as e:
            span.set({"kvstrata.error": failure_cause(e)})
            raise
        finally:
            span.end()

    async def _post_task(
        self, url: str, task: PrefillTask, watched: Watched, headers: dict[str, str]
    ) -> PrefillResult:
        """POST the room (`headers`: its trace context); raises PrefillUnresponsive if
        `url` stops answering first."""
        post = asyncio.ensure_future(
            self._client.post(f"{url}/pd/prefill", json=task.to_json(), headers=headers)
        )
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

    async def _recover(self, room: SentRoom, url: str, cause: str, why: str) -> None:
        """The room failed: start its request's next path, then settle the room (its pages
        wait for the prefill rank's promise not to write)."""
        attempts = room.history.then(url, why)  # as the request's next room will carry it
        logger.warning("room %s: prefill on %s failed (%s): %s", room.room_id, url, cause, why)
        outcome, message = "failed", None
        next_url = self.failures.next_url(attempts, cause)
        with contextlib.suppress(EngineUnavailable):
            if next_url is not None and await self._requeue(room, next_url, why):
                outcome = "retried"
            may_recompute = outcome == "failed" and self.failures.may_recompute(cause)
            if may_recompute and await self._requeue(room, None, why):
                outcome = "recomputed"
        # An error the request caused on the prefill rank is its own: it fails, not retried.
        kind = ErrorKind.FAILED if cause == "request_error" else ErrorKind.UNAVAILABLE
        if cause == "request_error":
            message = (
                f"prefill rank {url} failed on this request ({why}); not retried, as "
                "the request may be what broke it"
            )
        elif outcome == "failed":
            message = self.failures.give_up_message(attempts)
        self.failures.count(cause, outcome)
        await self._settle(url, room.room_id, message, kind)

    async def _requeue(self, room: SentRoom, target: str | None, why: str) -> bool:
        """A new room of the request, to `target`; None: this rank prefills it."""
        path = PrefillPath.LOCAL if target is None else PrefillPath.REMOTE
        return await self.engine_loop.run(self.role.requeue_room, room.room_id, path, target, why)

    async def _settle(
        self,
        url: str,
        room_id: str,
        message: str | None,
        kind: ErrorKind = ErrorKind.UNAVAILABLE,
    ) -> None:
        """Fail the request now (if `message`); free its pages once the prefill rank
        promised not to write (or cannot: it is gone)."""
        if message is not None:
            with contextlib.suppress(EngineUnavailable):
                await self.engine_loop.run_output(self.role.fail_room, room_id, message, kind)
        await self._abort_remote(url, room_id)
        with contextlib.suppress(EngineUnavailable):
            await self.engine_loop.run(self.role.release_room, room_id)

    async def _abort_remote(self, url: str, room_id: str) -> None:
        delay_s = 0.1
        while True:
            try:
                response = await self._client.post(f"{url}/pd/abort", json={"room": room_id})
                if response.status_code == 200:
                    return
                if response.status_code in (400, 422):
                    # It refuses the room id itself, so it never accepted a task of it.
                    logger.warning("room %s: %s refused the abort: %s", room_id, url, response.text)
                    return
            except httpx.ConnectError:
                return  # nothing listens there any more: no write can come
            except httpx.HTTPError:
                pass
            logger.warning("room %s: prefill rank %s has not confirmed the abort", room_id, url)
            await asyncio.sleep(delay_s)
            delay_s = min(delay_s * 2, 5.0)

    async def close(self) -> None:
        for flight in list(self._flights.values()):
            flight.task.cancel()
        await asyncio.gather(*(f.task for f in self._flights.values()), return_exceptions=True)
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
