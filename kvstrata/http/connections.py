"""Connection hygiene for a uvicorn front end (a rank or the router): `ConnectionGate`
counts the open connections per client address and in all, and makes room by closing idle
ones; `GatedH11Protocol` is uvicorn's h11 protocol with the gate and the deadlines uvicorn
lacks (a request head, a body's pace, a new connection that sends nothing)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import h11
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger("kvstrata.http")
LOG_INTERVAL_S = 10.0  # refusals and evictions come in floods: one line per interval


@dataclass(frozen=True)
class ConnectionLimits:
    """What one process accepts: `max_connections` in all, `max_connections_per_address`
    of one address, `num_reserved` more that serve `health_paths` only; and the deadlines
    that close a connection which holds a file without sending."""

    max_connections: int
    max_connections_per_address: int
    num_reserved: int
    keep_alive_timeout_s: float  # nothing sent: on a new connection, or between requests
    header_timeout_s: float  # from the connection's turn to send a head to its last byte
    body_timeout_s: float  # a body's allowance, plus 1 s per `min_body_bytes_per_s` received
    min_body_bytes_per_s: float
    retry_after_s: int = 1
    health_paths: frozenset[str] = frozenset({"/health"})


class Admission(enum.Enum):
    SERVED = "served"
    RESERVED = "reserved"  # past max_connections: health probes only, the rest 503
    REFUSED = "refused"  # a 503 at once, closed; never counted


ErrorJson = Callable[[int, str, str], bytes]  # (status, message, code) -> an error body


class ConnectionGate:
    """The open connections of one server, per address and in all (event loop only).

    A new connection past a bound first takes the place of the connection that has been
    idle longest (waiting for a request head; closed without an answer, as a keep-alive
    timeout would), that address's own for the address bound: idle connections never
    keep a request out. Only when every connection is busy does a new one get a 503 with
    Retry-After: past `max_connections` it still serves the health paths (probes keep
    seeing the process), past the reserve, or past its address's bound, it is closed at
    once. `error_json` renders the 503 bodies (the OpenAI shape)."""

    def __init__(self, limits: ConnectionLimits, error_json: ErrorJson) -> None:
        self.limits = limits
        self.error_json = error_json
        self.num_open = 0
        self.num_refused = 0
        self.num_evicted = 0
        self._per_address: collections.Counter[str] = collections.Counter()
        # Idle connections, longest idle first (dicts keep insertion order).
        self._idle: dict[GatedH11Protocol, None] = {}
        self._idle_of: dict[str, dict[GatedH11Protocol, None]] = {}
        self._logged_s: dict[str, float] = {}  # by kind of note: when last logged
        self._unlogged: collections.Counter[str] = collections.Counter()

    def admit(self, connection: GatedH11Protocol) -> tuple[Admission, str]:
        """Count a new (idle) connection in, making room if need be; or refuse it. The
        reason goes with RESERVED and REFUSED."""
        limits, address = self.limits, connection.address
        if self._per_address[address] >= limits.max_connections_per_address and not (
            self._evict_oldest(self._idle_of.get(address, {}))
        ):
            return self._refused(
                f"{address} holds {limits.max_connections_per_address} "
                "busy connections (--max-connections-per-address)"
            )
        if self.num_open >= limits.max_connections:
            self._evict_oldest(self._idle)
        if self.num_open >= limits.max_connections + limits.num_reserved:
            return self._refused(
                f"{self.num_open} connections are busy (--max-connections {limits.max_connections})"
            )
        self.num_open += 1
        self._per_address[address] += 1
        self.idle(connection)
        if self.num_open > limits.max_connections:
            paths = ", ".join(sorted(limits.health_paths))
            return Admission.RESERVED, (
                f"{limits.max_connections} connections are busy (--max-connections); only "
                f"{paths} is served on this one: retry in {limits.retry_after_s} s"
            )
        return Admission.SERVED, ""

    def idle(self, connection: GatedH11Protocol) -> None:
        """`connection` waits for a request head: it may make room for a new one."""
        if connection not in self._idle:
            self._idle[connection] = None
            self._idle_of.setdefault(connection.address, {})[connection] = None

    def busy(self, connection: GatedH11Protocol) -> None:
        """A request of `connection` is under way."""
        if connection in self._idle:
            del self._idle[connection]
            of_address = self._idle_of[connection.address]
            del of_address[connection]
            if not of_address:
                del self._idle_of[connection.address]

    def release(self, connection: GatedH11Protocol) -> None:
        self.busy(connection)
        self.num_open -= 1
        self._per_address[connection.address] -= 1
        if self._per_address[connection.address] <= 0:
            del self._per_address[connection.address]

    def refusal(self, message: str) -> bytes:
        """A whole 503 response that closes the connection."""
        body = self.error_json(503, message, "too_many_connections")
        head = (
            "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nretry-after: {self.limits.retry_after_s}\r\n"
            "connection: close\r\n\r\n"
        )
        return head.encode() + body

    def reserved_app(self, app: ASGIApp, why: str) -> ASGIApp:
        """`app` on the health paths (the connection closes after), 503 for the rest."""
        limits = self.limits
        body = self.error_json(503, why, "too_many_connections")
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", b"%d" % len(body)),
            (b"retry-after", b"%d" % limits.retry_after_s),
            (b"connection", b"close"),
        ]

        async def reserved(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http" or scope["path"] not in limits.health_paths:
                await send({"type": "http.response.start", "status": 503, "headers": headers})
                await send({"type": "http.response.body", "body": body})
                return

            async def closing_send(message: Message) -> None:
                if message["type"] == "http.response.start":
                    extra = [(b"connection", b"close")]
                    message = {**message, "headers": [*message.get("headers", []), *extra]}
                await send(message)

            await app(scope, receive, closing_send)

        return reserved

    def _evict_oldest(self, idle: dict[GatedH11Protocol, None]) -> bool:
        oldest = next(iter(idle), None)
        if oldest is None:
            return False
        self.release(oldest)
        oldest.close_idle()
        self.num_evicted += 1
        self._note("evicted", "idle connection(s) closed to make room for new ones")
        return True

    def _refused(self, reason: str) -> tuple[Admission, str]:
        self.num_refused += 1
        self._note("refused", f"new connection(s) refused: {reason}")
        return Admission.REFUSED, reason

    def _note(self, kind: str, what: str) -> None:
        self._unlogged[kind] += 1
        now_s = time.monotonic()
        if now_s - self._logged_s.get(kind, -LOG_INTERVAL_S) >= LOG_INTERVAL_S:
            logger.warning("%d %s", self._unlogged.pop(kind), what)
            self._logged_s[kind] = now_s


class GatedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, gated: `gate` admits a connection when it opens (or refuses
    it, or serves it health probes only) and releases it when it closes; and it is closed
    when it holds a file without sending:

    - nothing at all for `keep_alive_timeout_s` (a new connection, or between requests);
    - a request head not whole `header_timeout_s` after its turn began (a 408 if part of
      it came, else silently: a client may be reusing the connection at that moment);
    - a body behind its pace: `body_timeout_s` plus 1 s per `min_body_bytes_per_s`
      received since the head. Time while uvicorn paused reading (the app is slow to
      read, not the client to send) does not count.

    Subclass per server with `bound(gate)`: uvicorn builds protocols from a class."""

    gate: ClassVar[ConnectionGate]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.timeout_keep_alive = self.gate.limits.keep_alive_timeout_s  # type: ignore[assignment]
        self.address = ""
        self._counted = False  # in the gate's counts: admitted, not yet released
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0  # received since the turn to send a head began
        self._body_timer: asyncio.TimerHandle | None = None
        self._body_started_s = 0.0
        self._body_bytes = 0
        self._cycle_seen: object = None

    @classmethod
    def bound(cls, gate: ConnectionGate) -> type[GatedH11Protocol]:
        return cast(type[GatedH11Protocol], type(cls.__name__, (cls,), {"gate": gate}))

    # -- the gate ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.address = self.client[0] if self.client else ""
        admission, why = self.gate.admit(self)
        if admission is Admission.REFUSED:
            transport.write(self.gate.refusal(why))
            transport.close()
            return
        self._counted = True
        if admission is Admission.RESERVED:
            self.app = self.gate.reserved_app(self.app, why)
        self._await_head()
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )

    def connection_lost(self, exc: Exception | None) -> None:
        self._uncount()
        super().connection_lost(exc)

    def close_idle(self) -> None:
        """Close this idle connection now (the gate has released it)."""
        self._counted = False
        self._uncount()
        self._unset_keepalive_if_required()
        with contextlib.suppress(h11.LocalProtocolError):
            self.conn.send(h11.ConnectionClosed())
        self.transport.close()

    def _uncount(self) -> None:
        if self._counted:
            self._counted = False
            self.gate.release(self)
        _cancel(self._head_timer)
        self._head_timer = None
        _cancel(self._body_timer)
        self._body_timer = None

    # -- the deadlines -------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if not self._counted:
            return  # refused or evicted, and closing: its bytes are not read
        if self.conn.their_state is h11.SEND_BODY:
            self._body_bytes += len(data)
        else:
            self._head_bytes += len(data)
        super().data_received(data)
        self._after_events()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._after_events()

    def _after_events(self) -> None:
        """After h11 events were handled: start or stop the deadline of what is due, and
        tell the gate whether the connection is idle."""
        if not self._counted or self.transport.is_closing():
            return
        if self.cycle is not None and self.cycle is not self._cycle_seen:  # a new head
            self._cycle_seen = self.cycle
            _cancel(self._head_timer)
            self._head_timer = None
            if self.conn.their_state is h11.SEND_BODY:
                self._body_started_s, self._body_bytes = self.loop.time(), 0
                self._arm_body(self.gate.limits.body_timeout_s)
        if self.conn.their_state is not h11.SEND_BODY:
            _cancel(self._body_timer)
            self._body_timer = None
        if not (self.conn.our_state is h11.IDLE and self.conn.their_state is h11.IDLE):
            self.gate.busy(self)
            return
        self.gate.idle(self)  # between requests: the next head's turn
        if self._head_timer is None:
            self._await_head()
        if self.timeout_keep_alive_task is None and not self._head_bytes:
            # uvicorn arms it when a response ends, but a body that came in after the
            # response (the app answered early) cancelled it.
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )

    def _await_head(self) -> None:
        self._head_bytes = 0
        self._head_timer = self.loop.call_later(
            self.gate.limits.header_timeout_s, self._head_overdue
        )

    def _head_overdue(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if not (self.conn.our_state is h11.IDLE and self.conn.their_state is h11.IDLE):
            return  # a request is under way: its head came
        if self._head_bytes:
            self.transport.write(
                b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
            )
        with contextlib.suppress(h11.LocalProtocolError):
            self.conn.send(h11.ConnectionClosed())
        self.transport.close()

    def _arm_body(self, delay_s: float) -> None:
        _cancel(self._body_timer)
        self._body_timer = None
        self._body_timer = self.loop.call_later(max(delay_s, 0.01), self._body_check)

    def _body_check(self) -> None:
        self._body_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.SEND_BODY:
            return  # the body is whole (or the connection going)
        limits = self.gate.limits
        now_s = self.loop.time()
        if self.flow.read_paused:  # the app is behind, not the client: the pace restarts
            self._body_started_s, self._body_bytes = now_s, 0
        due_s = self._body_started_s + limits.body_timeout_s
        due_s += self._body_bytes / limits.min_body_bytes_per_s
        if now_s < due_s:
            self._arm_body(due_s - now_s)
            return
        logger.info(
            "%s: closing a connection whose request body is behind its pace (%d bytes in %.1f s)",
            self.address,
            self._body_bytes,
            now_s - self._body_started_s,
        )
        self.transport.close()  # the app sees the client disconnect


def _cancel(timer: asyncio.TimerHandle | None) -> None:
    if timer is not None:
        timer.cancel()
