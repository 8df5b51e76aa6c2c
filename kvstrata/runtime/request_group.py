"""The request group: the engine requests of one HTTP call as the event loop sees them,
with the errors a group can end in, and `final_outputs` (a group's end, or None if its
client left first)."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

from fastapi import Request

from kvstrata.core import RequestOutput
from kvstrata.http.disconnect import until_disconnect
from kvstrata.http.errors import StatusError


class GroupMetrics(Protocol):
    """What a group reports as its requests advance (a rank's ServerMetrics)."""

    def observe_first_token(self, ttft_s: float) -> None: ...

    def observe_finished(self, out: RequestOutput, decode_s: float | None) -> None: ...


class GroupError(StatusError):
    """How a group's requests ended without finishing: the HTTP status and error code the
    client sees. Each subclass says who may send the request again."""


class EngineUnavailable(GroupError, RuntimeError):
    """The engine thread is stopping, stopped or failed; no new work is accepted. Another
    rank may serve the request (the router retries a 503)."""

    status_code = 503
    code = "engine_unavailable"


class RequestRejected(GroupError, ValueError):
    """The engine refused a request at admission (the server's own checks should have)."""

    status_code = 400
    code = "invalid_request"


class RequestFailed(GroupError, RuntimeError):
    """The request met an error of its own in the engine (e.g. its sampling raised); only
    it failed and the engine goes on. Not retried: it would fail again."""

    code = "request_failed"


class EngineFailed(GroupError, RuntimeError):
    """The engine failed in a step that held this request, with an error it could not
    pin on one request; the rank ends so its supervisor starts it again. Not retried: the
    request may be what broke it (docs/reliability.md, "Containment")."""

    code = "engine_failed"


class GroupClosed(Exception):
    """The group was closed (its requests aborted) before every final output arrived."""


class RequestGroup:
    """The engine requests of one HTTP call (one per prompt, numbered 0..n-1) and the
    outputs delivered for them. Lives on the event loop; the engine thread only schedules
    `_deliver` / `_fail` calls on it. Iterating yields `(index, RequestOutput)` until every
    request has finished; a rejection or engine failure is raised from the iteration.

    Whoever submits a group must `close()` it (or use it as a context manager) when done:
    that aborts the requests still unfinished, so a client that leaves frees its pages."""

    def __init__(
        self, rids: list[str], metrics: GroupMetrics | None, abort: Callable[[list[str]], None]
    ) -> None:
        self.rids = rids
        self._abort = abort
        self._index = {rid: i for i, rid in enumerate(rids)}
        # Unread outputs, one per prompt index: a newer output replaces an unread older one
        # (outputs are cumulative), so a stalled reader holds O(prompts) outputs, not one
        # per step. `_order`: indices with an unread output, in delivery order.
        self._unread: dict[int, RequestOutput] = {}
        self._order: deque[int] = deque()
        self._error: Exception | None = None
        self._ready = asyncio.Event()
        self._metrics = metrics
        self._submit_s = time.monotonic()
        self._first_token_s: dict[int, float] = {}
        self._finished: set[int] = set()
        self._on_close: list[Callable[[], None]] = []
        self._on_first_token: list[Callable[[RequestOutput], None]] = []

    @property
    def all_finished(self) -> bool:
        return len(self._finished) == len(self.rids)

    def unfinished_rids(self) -> list[str]:
        return [rid for i, rid in enumerate(self.rids) if i not in self._finished]

    def close(self) -> None:
        """Abort every request not finished yet, then run the `call_on_close` callbacks
        (once); idempotent."""
        rids = self.unfinished_rids()
        if rids:
            self._finished.update(range(len(self.rids)))
            self._abort(rids)
        callbacks, self._on_close = self._on_close, []
        for callback in callbacks:
            callback()

    def call_on_close(self, callback: Callable[[], None]) -> None:
        """Run `callback` when the group is closed (its submitter is done with it)."""
        self._on_close.append(callback)

    def call_on_first_token(self, callback: Callable[[RequestOutput], None]) -> None:
        """Run `callback(out)` with each request's first output that holds a token (its
        cache usage is final from then on), as it is delivered."""
        self._on_first_token.append(callback)

    def __enter__(self) -> RequestGroup:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def final_outputs(self) -> list[RequestOutput]:
        """Wait for every request to finish; their last outputs, in prompt order. Raises
        GroupClosed if `close` came first (e.g. a prefill room's /pd/abort)."""
        finals: dict[int, RequestOutput] = {}
        async for index, out in self:
            if out.finished:
                finals[index] = out
        if len(finals) < len(self.rids):
            raise GroupClosed(f"{len(self.rids) - len(finals)} request(s) closed unfinished")
        return [finals[i] for i in range(len(self.rids))]

    def __aiter__(self) -> RequestGroup:
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        # `_finished` is updated on delivery, before the consumer reads the outputs.
        while True:
            if self._order:
                index = self._order.popleft()
                return index, self._unread.pop(index)
            if self._error is not None:
                error, self._error = self._error, None
                raise error
            if self.all_finished:
                raise StopAsyncIteration
            self._ready.clear()
            await self._ready.wait()

    def _deliver(self, out: RequestOutput) -> None:
        index = self._index[out.rid]
        now = time.monotonic()
        if out.new_token_ids and index not in self._first_token_s:
            self._first_token_s[index] = now
            if self._metrics is not None:
                self._metrics.observe_first_token(now - self._submit_s)
            for callback in self._on_first_token:
                callback(out)
        if out.finished:
            self._finished.add(index)
            if self._metrics is not None:
                first_s = self._first_token_s.get(index)
                self._metrics.observe_finished(out, None if first_s is None else now - first_s)
        if index not in self._unread:
            self._order.append(index)
        self._unread[index] = out
        self._ready.set()

    def _fail(self, error: Exception) -> None:
        self._finished.update(range(len(self.rids)))
        self._error = error
        self._ready.set()


# -- commands (event loop -> engine thread) ----------------------------------------------


async def final_outputs(request: Request, group: RequestGroup) -> list[RequestOutput] | None:
    """The group's final outputs, or None if the client disconnected first. The group is
    closed either way, so a request nobody waits for any more is aborted."""
    with group:
        return await until_disconnect(request, group.final_outputs())
