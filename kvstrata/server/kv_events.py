"""`GET /kv_events` of a rank and its publisher: cache digest deltas and load pushed to
subscribers (routers) as they happen, one bounded queue per subscriber, a few per client
address, each freed when its subscriber goes. The engine thread only wakes the publisher;
it never waits on a subscriber."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import secrets
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated

from fastapi import APIRouter, Query, Request

from kvstrata.http.closing_stream import ClosingStream
from kvstrata.http.errors import OpenAIError
from kvstrata.http.kv_event_wire import KV_EVENTS_MEDIA_TYPE, EventKind, KvEvent
from kvstrata.http.middleware import CLUSTER_KEY_HEADER, holds_cluster_key
from kvstrata.runtime.request_group import EngineUnavailable
from kvstrata.server.state import StateDep

if TYPE_CHECKING:
    from kvstrata.engine.engine import Engine
    from kvstrata.engine.load import EngineLoad
    from kvstrata.kvcache.digest_wire import DigestDelta
    from kvstrata.runtime.engine_loop import EngineLoop

logger = logging.getLogger("kvstrata.server")
MAX_SUBSCRIBERS = 64  # routers of one cluster; each costs a queue and a stream
# Per client address: a router holds one stream per rank (two for a moment while it
# resubscribes), and a few routers may share a host; so no one address fills the 64.
MAX_SUBSCRIBERS_PER_HOLDER = 8
HEARTBEAT_RANGE_S = (0.05, 60.0)

router = APIRouter()


@dataclass(frozen=True)
class PublisherConfig:
    queue_size: int  # events one subscriber may have unread before it is dropped
    load_interval_s: float  # how often the load is looked at for a change


@dataclass
class Subscription:
    """One subscriber's queue. Events are numbered as they are queued; `None` ends it."""

    queue: asyncio.Queue[KvEvent | None]
    chunk_size: int | None
    holder: str = ""  # the subscriber's client address
    next_seq: int = 0
    started: bool = False  # its snapshot was queued
    last_epoch: str = ""

    def numbered(self, event: KvEvent) -> KvEvent:
        event = dataclasses.replace(event, seq=self.next_seq)
        self.next_seq += 1
        self.last_epoch = event.epoch
        return event


@dataclass(frozen=True)
class _Collected:
    """What one engine-thread visit read: the load, and the digest's changes since the
    publisher's last version (`delta`) and/or in full (`snapshot`)."""

    load: EngineLoad
    has_digest: bool
    delta: DigestDelta | None = None
    snapshot: DigestDelta | None = None


@dataclass
class KvEventPublisher:
    """Fans a rank's digest changes and load out to its subscribers. Lives on the event
    loop; its engine visits go through `EngineLoop.call`, between two engine steps.

    The digest's `on_change` hook (engine thread) only schedules a wake-up here, so a
    version's changes are collected once, however many pages changed. A subscriber whose
    queue is full is dropped (its stream ends with a DROPPED event) instead of making
    anyone wait; it subscribes again and starts from a snapshot."""

    engine_loop: EngineLoop
    rank: int
    config: PublisherConfig
    l3_store: str | None = None  # the L3 store's id (l3_index.py), sent with the load
    instance: str = field(default_factory=lambda: secrets.token_hex(8))
    _subscribers: list[Subscription] = field(default_factory=list)
    _version: tuple[str, int] | None = None  # (epoch, version) the subscribers hold
    _last_load: EngineLoad | None = None
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    _task: asyncio.Task[None] | None = None
    _closed: bool = False

    @property
    def chunk_size(self) -> int | None:
        return next((s.chunk_size for s in self._subscribers if s.chunk_size), None)

    def subscribe(self, chunk_size: int | None, holder: str = "") -> Subscription:
        """Raises OpenAIError: too many subscribers (in all, or of `holder`, a client
        address), or another chunk size than theirs (the digest keeps one: routers of a
        cluster share --dp-routing-digest-chunk-size)."""
        if self._closed:
            raise OpenAIError(503, "this rank is shutting down", code="shutting_down")
        if len(self._subscribers) >= MAX_SUBSCRIBERS:
            raise OpenAIError(503, f"{MAX_SUBSCRIBERS} subscribers already", code="too_many")
        if sum(s.holder == holder for s in self._subscribers) >= MAX_SUBSCRIBERS_PER_HOLDER:
            raise OpenAIError(
                503,
                f"{holder or 'this client'} holds {MAX_SUBSCRIBERS_PER_HOLDER} kv_events "
                "subscriptions already (the most one client address may hold)",
                code="too_many",
            )
        current = self.chunk_size
        if chunk_size is not None and current is not None and chunk_size != current:
            raise OpenAIError(
                409,
                f"digest_chunk_size {chunk_size} differs from the {current} other "
                "subscribers stream (the routers of a cluster need one chunk size)",
                "digest_chunk_size",
                "chunk_size_conflict",
            )
        subscription = Subscription(asyncio.Queue(self.config.queue_size), chunk_size, holder)
        self._subscribers.append(subscription)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="kvstrata-kv-events")
        self._wake.set()
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        with contextlib.suppress(ValueError):
            self._subscribers.remove(subscription)

    def close(self) -> None:
        """End every stream (a shutdown: uvicorn waits for open responses to finish)."""
        self._closed = True
        for subscription in self._subscribers:
            _end(subscription, None)
        self._subscribers.clear()
        if self._task is not None:
            self._task.cancel()

    # -- the publishing loop -------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()

        def on_change() -> None:  # engine thread: hand over a wake-up, never wait
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody to tell
                loop.call_soon_threadsafe(self._wake.set)

        while self._subscribers:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.config.load_interval_s)
            self._wake.clear()
            subscribers = list(self._subscribers)
            if not subscribers:
                break
            collect = functools.partial(
                self._collect,
                on_change=on_change,
                chunk_size=self.chunk_size,
                needs_snapshot=any(not s.started for s in subscribers),
            )
            try:
                collected = await self.engine_loop.call(collect)
            except EngineUnavailable:
                self.close()
                return
            self._publish(subscribers, collected)

    def _collect(
        self,
        engine: Engine,
        on_change: Callable[[], None],
        chunk_size: int | None,
        needs_snapshot: bool,
    ) -> _Collected:
        """Engine thread: the load, and the digest since the subscribers' version."""
        load = engine.load()
        digest = engine.tiers.digest
        if digest is None or chunk_size is None:
            return _Collected(load, has_digest=digest is not None)
        digest.on_change = on_change
        epoch, version = self._version or (None, None)
        delta = engine.cache_digest(chunk_size, epoch, version)
        snapshot = None
        if needs_snapshot:
            snapshot = (
                delta
                if delta is not None and delta.full
                else (engine.cache_digest(chunk_size, None, None))
            )
        return _Collected(load, True, delta, snapshot)

    def _publish(self, subscribers: list[Subscription], collected: _Collected) -> None:
        load = collected.load
        load_body: dict[str, object] = {"rank": self.rank, "l3_store": self.l3_store}
        load_body |= dataclasses.asdict(load) | {"num_used_pages": load.num_used_pages}
        delta = collected.delta
        epoch = delta.epoch if delta is not None else self.instance
        changed = delta is not None and (
            delta.full or delta.num_changes > 0 or (epoch, delta.version) != self._version
        )
        if delta is not None:
            self._version = (delta.epoch, delta.version)
        load_changed = load != self._last_load
        self._last_load = load
        for subscription in subscribers:
            if not subscription.started:
                digest = collected.snapshot if subscription.chunk_size else None
                event = KvEvent(EventKind.SNAPSHOT, 0, epoch, load_body, digest)
                subscription.started = True
            elif changed and subscription.chunk_size and delta is not None:
                kind = EventKind.SNAPSHOT if delta.full else EventKind.DELTA
                event = KvEvent(kind, 0, epoch, load_body, delta)
            elif load_changed or changed:
                event = KvEvent(EventKind.LOAD, 0, epoch, load_body)
            else:
                continue
            self._offer(subscription, event)

    def _offer(self, subscription: Subscription, event: KvEvent) -> None:
        try:
            subscription.queue.put_nowait(subscription.numbered(event))
        except asyncio.QueueFull:
            logger.warning("a kv_events subscriber fell behind; dropping it (it resyncs)")
            self.unsubscribe(subscription)
            dropped = KvEvent(EventKind.DROPPED, subscription.next_seq, subscription.last_epoch)
            _end(subscription, dropped)


def _end(subscription: Subscription, last: KvEvent | None) -> None:
    """Empty the queue and leave `last` (if any) and the end marker in it."""
    while not subscription.queue.empty():
        subscription.queue.get_nowait()
    if last is not None:
        subscription.queue.put_nowait(last)
    with contextlib.suppress(asyncio.QueueFull):  # a queue of one holds `last` only
        subscription.queue.put_nowait(None)


async def _lines(
    publisher: KvEventPublisher, subscription: Subscription, heartbeat_s: float
) -> AsyncGenerator[bytes, None]:
    try:
        last: KvEvent | None = None
        while True:
            try:
                event = await asyncio.wait_for(subscription.queue.get(), heartbeat_s)
            except TimeoutError:
                if last is None:
                    continue  # nothing to repeat before the snapshot
                beat = KvEvent(EventKind.HEARTBEAT, last.seq, subscription.last_epoch)
                yield beat.to_line()
                continue
            if event is None:
                return
            last = event
            yield event.to_line()
            if event.kind is EventKind.DROPPED:
                return
    finally:
        publisher.unsubscribe(subscription)


def publisher_of(request: Request) -> KvEventPublisher:
    return request.app.state.kvstrata_events


@router.get("/kv_events", responses={401: {}, 409: {}, 503: {}})
async def kv_events(
    request: Request,
    state: StateDep,
    digest_chunk_size: Annotated[
        int | None,
        Query(description="Stream the digest at this chunk size (tokens); absent: load only."),
    ] = None,
    heartbeat_s: Annotated[
        float, Query(description="Seconds between heartbeats on a quiet stream.")
    ] = 1.0,
) -> ClosingStream:
    """Digest deltas and load as they happen (JSON lines, one KvEvent each). Rank-to-rank
    only: the caller needs the cluster key (checked at the door, ClusterKeyMiddleware, and
    again here). The subscription ends, and its slot is free, as soon as the stream does."""
    if not holds_cluster_key(request.scope["headers"], state.config.cluster_key):
        raise OpenAIError(
            401,
            f"/kv_events is for the ranks and routers of this cluster: send {CLUSTER_KEY_HEADER}",
            code="invalid_cluster_key",
        )
    unknown = sorted(set(request.query_params) - {"digest_chunk_size", "heartbeat_s"})
    if unknown:
        raise OpenAIError(400, f"unknown query parameter {unknown[0]!r}", unknown[0])
    page_size = state.info["page_size"]
    if digest_chunk_size is not None and (digest_chunk_size < 1 or digest_chunk_size % page_size):
        raise OpenAIError(
            400,
            f"digest_chunk_size must be a positive multiple of the page size {page_size}, "
            f"got {digest_chunk_size}",
            "digest_chunk_size",
        )
    if not HEARTBEAT_RANGE_S[0] <= heartbeat_s <= HEARTBEAT_RANGE_S[1]:
        raise OpenAIError(
            400,
            f"heartbeat_s must be in [{HEARTBEAT_RANGE_S[0]}, {HEARTBEAT_RANGE_S[1]}], got "
            f"{heartbeat_s}",
            "heartbeat_s",
        )
    publisher = publisher_of(request)
    holder = request.client.host if request.client is not None else ""
    subscription = publisher.subscribe(digest_chunk_size, holder)

    async def on_close() -> None:  # client gone, rank stopping, or a stream that never began
        publisher.unsubscribe(subscription)

    lines = _lines(publisher, subscription, heartbeat_s)
    return ClosingStream(lines, on_close, media_type=KV_EVENTS_MEDIA_TYPE)
