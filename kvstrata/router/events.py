"""The router's subscriptions to its ranks' `GET /kv_events`: one long-lived stream per
rank, whose events (digest deltas and load, kv_event_wire.py) are applied to the registry
as they arrive; a gap, an epoch change outside a snapshot or a quiet stream ends the
subscription, and the rank is polled (workers.LoadInquirer) until a new one starts."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

import httpx

from kvstrata.errors_text import describe_error
from kvstrata.http.kv_event_wire import EventKind, KvEvent
from kvstrata.router.policy import RankLoad
from kvstrata.router.workers import RankState, Role, WorkerRegistry

logger = logging.getLogger("kvstrata.router")
MISSED_HEARTBEATS = 3  # a stream quiet this many heartbeats long is taken for dead
# After an event, this long without another means the rank's load has settled: every
# decision made before that event had reached the rank by then, and a change it made to
# the load would have been pushed (ranks check their load every 0.05 s by default). If a
# long engine step delays that push, the router's own lower bounds (its requests in
# flight, their new tokens before the first token) still count those decisions.
SETTLE_S = 0.1
# A rank without /kv_events (404: an older rank, a stand-in) is asked again this many
# reconnect intervals later; it is polled meanwhile.
UNSUPPORTED_BACKOFF = 20


@dataclass(frozen=True)
class StreamSettings:
    chunk_size: int | None  # ask decode ranks for their digest at this size
    heartbeat_s: float
    reconnect_s: float
    connect_timeout_s: float


async def stop_task(task: asyncio.Task[None] | None) -> None:
    """Cancel a background task of the router and wait until it has ended."""
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


class StreamGap(Exception):
    """The stream broke its order (kv_event_wire.KvEvent's rules) or ended: resubscribe."""


class EventStreams:
    """One subscription task per rank. `watch` a rank when it joins, `unwatch` it when it
    leaves; `stop` ends all of them."""

    def __init__(
        self, registry: WorkerRegistry, client: httpx.AsyncClient, settings: StreamSettings
    ) -> None:
        self.registry = registry
        self.client = client
        self.settings = settings
        self._tasks: dict[str, asyncio.Task[None]] = {}  # worker id -> its subscription
        self._settles: dict[str, asyncio.TimerHandle] = {}  # worker id -> its pending settle
        self.num_resyncs = 0  # subscriptions that ended and were started again

    def watch(self, rank: RankState) -> None:
        if rank.worker_id not in self._tasks:
            self._tasks[rank.worker_id] = asyncio.create_task(
                self._follow(rank), name=f"kvstrata-kv-events-{rank.worker_id}"
            )

    async def unwatch(self, rank: RankState) -> None:
        await stop_task(self._tasks.pop(rank.worker_id, None))
        self._cancel_settle(rank)
        rank.events_live = False

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for handle in self._settles.values():
            handle.cancel()
        self._settles.clear()
        await asyncio.gather(*(stop_task(task) for task in tasks))

    async def _follow(self, rank: RankState) -> None:
        problem = None
        while True:
            backoff = 1
            try:
                await self._subscribe(rank)
                new_problem = "its event stream ended"
            except _Unsupported as e:
                new_problem, backoff = str(e), UNSUPPORTED_BACKOFF
            except StreamGap as e:
                new_problem = str(e)
            except (httpx.HTTPError, ValueError) as e:
                new_problem = describe_error(e, qualified=True)
            except Exception as e:  # a bug here must not end the subscription for good
                logger.exception("%s: the event stream failed", rank.name)
                new_problem = describe_error(e, qualified=True)
            if rank.events_live:
                self.num_resyncs += 1
                logger.info("%s: events stopped (%s); polling it", rank.name, new_problem)
            elif new_problem != problem:
                logger.info("%s: no event stream (%s); polling it", rank.name, new_problem)
            problem = new_problem
            rank.events_live = False
            await asyncio.sleep(self.settings.reconnect_s * backoff)

    async def _subscribe(self, rank: RankState) -> None:
        params: dict[str, str | float] = {"heartbeat_s": self.settings.heartbeat_s}
        asks_digest = rank.role is Role.DECODE and self.settings.chunk_size is not None
        if asks_digest:
            params["digest_chunk_size"] = str(self.settings.chunk_size)
        timeout = httpx.Timeout(
            self.settings.heartbeat_s * MISSED_HEARTBEATS,
            connect=self.settings.connect_timeout_s,
        )
        url = f"{rank.url}/kv_events"
        rank.event_mark = self.registry.poll_mark(rank)
        async with self.client.stream("GET", url, params=params, timeout=timeout) as response:
            if response.status_code == 404:
                raise _Unsupported("it serves no /kv_events")
            if response.status_code != 200:
                await response.aread()
                raise _Unsupported(
                    f"/kv_events answered {response.status_code}: {response.text[:200]}"
                )
            last: KvEvent | None = None
            loop = asyncio.get_running_loop()
            async for line in response.aiter_lines():
                if not line:
                    continue
                event = KvEvent.from_line(line)
                last = self._apply(rank, last, event, asks_digest)
                if event.kind is not EventKind.HEARTBEAT:
                    self._cancel_settle(rank)
                    self._settles[rank.worker_id] = loop.call_later(SETTLE_S, self._quiet, rank)

    def _apply(
        self, rank: RankState, last: KvEvent | None, event: KvEvent, asks_digest: bool
    ) -> KvEvent:
        """Check `event` follows `last` and hand it to the registry; the new last event."""
        if event.kind is EventKind.HEARTBEAT:
            if last is None or event.seq != last.seq:
                raise StreamGap(f"a heartbeat at seq {event.seq} out of order")
            self._quiet(rank)
            return last
        if event.kind is EventKind.DROPPED:
            raise StreamGap("the rank dropped this router's stream (it fell behind)")
        if last is None and event.kind is not EventKind.SNAPSHOT:
            raise StreamGap(f"the stream began with a {event.kind.value} event")
        if last is not None and event.seq != last.seq + 1:
            raise StreamGap(f"event {event.seq} after {last.seq}")
        if last is not None and event.epoch != last.epoch and event.kind is not EventKind.SNAPSHOT:
            raise StreamGap(f"epoch {last.epoch} -> {event.epoch} outside a snapshot")
        assert event.load is not None  # KvEvent.from_line: every such kind has one
        load = RankLoad.from_json(event.load)
        has_digest = asks_digest and event.kind is not EventKind.LOAD
        # Decisions after the previous event may be missing from this one's load, as
        # decisions after a poll was sent may be missing from its answer.
        mark = rank.event_mark
        self.registry.on_poll_answer(rank, load, mark, has_digest, event.digest)
        if has_digest and rank.digest_dropped:
            raise StreamGap("a delta that does not start at the router's version")
        rank.event_mark = self.registry.poll_mark(rank)
        rank.events_live = True
        return event

    def _cancel_settle(self, rank: RankState) -> None:
        handle = self._settles.pop(rank.worker_id, None)
        if handle is not None:
            handle.cancel()

    def _quiet(self, rank: RankState) -> None:
        """The stream was quiet for SETTLE_S after an event, or sent a heartbeat: a
        decision made before the last event (or heartbeat) reached the rank since, and
        would have changed its load, which would have been pushed; so it is in the load
        the router holds. That load is applied again with the newer mark. Without this a
        quiet rank would count its last decisions as unseen by it until its next change
        (an event's load is applied with the mark of the event before it, as a poll's
        with the counts when it was sent)."""
        self._settles.pop(rank.worker_id, None)
        if not rank.events_live or rank.load is None:
            return
        self.registry.on_poll_answer(rank, rank.load, rank.event_mark)
        rank.event_mark = self.registry.poll_mark(rank)


class _Unsupported(Exception):
    """The rank does not offer the stream (or refused this router)."""
