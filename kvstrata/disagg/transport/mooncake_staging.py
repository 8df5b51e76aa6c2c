"""The decode side of coalesced `mooncake` writes: a registered staging region of slots that
senders lease over the authenticated channel of `mooncake_control`, write large transfers
into, and ask this rank to scatter into its pool's pages; the answer settles their write."""

from __future__ import annotations

import contextlib
import hmac
import logging
import secrets
import socket
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import torch

from kvstrata.disagg.transport.endpoints import StagingEndpoint
from kvstrata.disagg.transport.mooncake_control import (
    SECRET_BYTES,
    ControlError,
    fields,
    hello_mac,
    parse_nonce,
    recv_frame,
    send_frame,
)
from kvstrata.disagg.transport.write_timeline import TIMELINE

log = logging.getLogger("kvstrata.disagg")

SLOTS_PER_LINK = 4  # slots one sender leases: 4 x 8 MiB keeps 32 MiB on the wire
_MAX_PEER_CHARS = 128


def pool_items(data: torch.Tensor) -> torch.Tensor:
    """A `[num_layers, 2, num_pages, ...]` pool as `[num_planes * num_pages, chunk_bytes]`
    bytes: item `plane * num_pages + page` is one page of one plane (no copy)."""
    num_items = data.shape[0] * data.shape[1] * data.shape[2]
    return data.view(-1).view(torch.uint8).view(num_items, -1)


@dataclass(frozen=True)
class StagingInfo:
    """What a sender needs to use a decode rank's staging region (part of its endpoint).
    `secret` (hex) is what its control server asks a sender to prove it holds; it travels
    only inside the endpoint (over the cluster-keyed rank-to-rank call) and is never shown."""

    host: str
    port: int
    base_ptr: int
    slot_bytes: int
    secret: str = field(repr=False)
    every_write: bool = False  # the rank asks that every write come through staging

    def to_json(self) -> StagingEndpoint:
        return StagingEndpoint(
            host=self.host,
            port=self.port,
            base_ptr=self.base_ptr,
            slot_bytes=self.slot_bytes,
            secret=self.secret,
            every_write=self.every_write,
        )

    @staticmethod
    def from_json(value: Any) -> StagingInfo:
        """Raises ValueError for a malformed description (never quoting the secret)."""
        if not isinstance(value, dict):
            raise ValueError("staging is not an object")
        types = {
            "host": str,
            "port": int,
            "base_ptr": int,
            "slot_bytes": int,
            "secret": str,
            "every_write": bool,
        }
        try:
            fields({"op": "staging", **value}, "staging", types)
            parse_nonce(value["secret"])
        except ControlError as e:
            raise ValueError(str(e)) from None
        if not 0 < value["port"] < 65536 or value["slot_bytes"] < 1 or value["base_ptr"] < 0:
            raise ValueError("staging: port, slot_bytes or base_ptr out of range")
        return StagingInfo(**value)


@dataclass(frozen=True)
class StagingLimits:
    """What the control server grants. A connection must prove it holds the secret within
    `message_s` and any started message must complete within it; an authenticated link
    idle for `idle_s` is closed (its sender opens a new one)."""

    quarantine_s: float  # a slot a connection left is leasable again only after it
    message_s: float
    idle_s: float = 60.0
    max_links: int = 64  # authenticated connections in all
    max_links_per_peer: int = 2  # and of one sender (by the name its hello proved)
    max_pending: int = 16  # not yet authenticated: a new one displaces the oldest


@dataclass(eq=False)
class _Link:
    conn: socket.socket
    peer: str | None = None  # set once authenticated
    slots: list[int] = field(default_factory=list)
    next_seq: int = 0


class StagingServer:
    """Owns `staging` (`[num_slots, slot_bytes]` bytes on the pool's device or in pinned host
    memory, registered by the caller) and the control socket. Invariants: only a
    connection that proved it holds `secret` leases or scatters; any malformed, refused
    or late message closes that connection alone; a slot is leased to one connection at
    a time (a sender's links together hold at most SLOTS_PER_LINK) and scattered only on
    that connection's request, which comes after the sender saw its transfers complete
    (Mooncake >= 0.3.12 reports a tcp write complete once applied at the destination),
    into distinct pool items; a slot a connection left is leasable again only after
    `quarantine_s`, so bytes of an abandoned write still on the wire cannot land in
    another sender's data."""

    def __init__(
        self,
        pool_data: torch.Tensor,
        staging: torch.Tensor,
        host: str,
        secret: bytes,
        limits: StagingLimits,
    ) -> None:
        self._items = pool_items(pool_data)
        self._staging = staging
        self._secret = secret
        self.limits = limits
        self._item_bytes = self._items.shape[1]
        self._items_per_slot = staging.shape[1] // self._item_bytes
        self._lock = threading.Lock()  # guards everything below
        self._free_after_s = [0.0] * staging.shape[0]  # leasable from then on
        self._leased: set[int] = set()
        self._pending: deque[_Link] = deque()  # accepted, not yet authenticated
        self._links: set[_Link] = set()  # authenticated
        self._peer_links: Counter[str] = Counter()
        self._peer_slots: Counter[str] = Counter()
        self._threads: set[threading.Thread] = set()
        self._closed = False
        self._listener = socket.create_server((host, 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, name="kv-staging", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # closed
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            link, displaced = _Link(conn), None
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                if len(self._pending) >= self.limits.max_pending:
                    displaced = self._pending.popleft()
                self._pending.append(link)
                thread = threading.Thread(target=self._serve, args=(link,), daemon=True)
                self._threads.add(thread)
            if displaced is not None:  # its thread sees the shutdown and cleans up
                _shutdown(displaced.conn)
            thread.start()

    def _serve(self, link: _Link) -> None:
        """One connection: the handshake, then `lease` and `scatter` requests, each answered
        once done; the lease ends with the connection."""
        conn, limits = link.conn, self.limits
        stream = torch.cuda.Stream(self._items.device) if self._items.is_cuda else None
        try:
            self._authenticate(link)
            while True:
                header, payload = recv_frame(
                    conn, 8 * self._items_per_slot, limits.idle_s, limits.message_s
                )
                answer: dict[str, object]
                if header.get("op") == "lease":
                    answer = {"op": "leased", "slots": self._lease(link, header)}
                else:
                    self._scatter(link, fields(header, "scatter", _SCATTER), payload, stream)
                    answer = {"op": "scattered", "seq": link.next_seq - 1}
                conn.settimeout(limits.message_s)  # a peer that never reads is dropped
                send_frame(conn, answer)
        except Exception as e:  # whatever a peer sent ends its own connection only
            if link.peer is None:  # unauthenticated: told nothing, logged quietly
                log.debug("mooncake staging: refused a connection: %s", e)
            elif "closed" not in str(e):
                log.warning("mooncake staging: dropping %s's connection: %s", link.peer, e)
                if isinstance(e, ControlError):
                    with contextlib.suppress(OSError):
                        conn.settimeout(limits.message_s)
                        send_frame(conn, {"op": "refused", "error": str(e)})
        finally:
            conn.close()
            self._forget(link)

    def _authenticate(self, link: _Link) -> None:
        """Challenge, hello, welcome: the sender proves it holds the secret without sending
        it; refused peers learn nothing (the connection just closes)."""
        deadline_s = time.monotonic() + self.limits.message_s
        server_nonce = secrets.token_hex(SECRET_BYTES)
        send_frame(link.conn, {"op": "challenge", "nonce": server_nonce})
        remaining_s = max(deadline_s - time.monotonic(), 1e-3)
        header, _ = recv_frame(link.conn, 0, remaining_s, remaining_s)
        hello = fields(header, "hello", {"peer": str, "nonce": str, "mac": str})
        peer, client_nonce = hello["peer"], parse_nonce(hello["nonce"])
        expected = hello_mac(self._secret, server_nonce, client_nonce, peer)
        if not hmac.compare_digest(expected, hello["mac"]):
            raise ControlError("a connection without the staging secret")
        if not 0 < len(peer) <= _MAX_PEER_CHARS:
            raise ControlError("hello: peer must be 1-128 characters")
        with self._lock:
            if link not in self._pending:
                raise ControlError("displaced before it authenticated")
            self._pending.remove(link)
            link.peer = peer
            too_many = (
                len(self._links) >= self.limits.max_links
                or self._peer_links[peer] >= self.limits.max_links_per_peer
            )
            if not too_many:
                self._links.add(link)
                self._peer_links[peer] += 1
        if too_many:
            raise ControlError("too many staging links")
        send_frame(link.conn, {"op": "welcome"})

    def _lease(self, link: _Link, header: dict[str, Any]) -> list[int]:
        num_slots = fields(header, "lease", {"num_slots": int})["num_slots"]
        if not 1 <= num_slots <= SLOTS_PER_LINK:
            raise ControlError(f"lease: num_slots must be 1-{SLOTS_PER_LINK}")
        if link.slots:
            raise ControlError("lease: this link already holds slots")
        assert link.peer is not None
        now_s = time.monotonic()
        with self._lock:
            num_slots = min(num_slots, SLOTS_PER_LINK - self._peer_slots[link.peer])
            free = [
                s for s, t in enumerate(self._free_after_s) if s not in self._leased and t <= now_s
            ]
            link.slots = free[: max(num_slots, 0)]
            self._leased.update(link.slots)
            self._peer_slots[link.peer] += len(link.slots)
        return list(link.slots)

    def _scatter(
        self, link: _Link, header: dict[str, Any], payload: bytes, stream: torch.cuda.Stream | None
    ) -> None:
        """Copies item i of the slot into pool item `ids[i]`; ControlError if anything in the
        request is off (then nothing was copied)."""
        slot, seq, num_items = header["slot"], header["seq"], header["num_items"]
        if slot not in link.slots:
            raise ControlError("scatter: the slot is not leased by this link")
        if seq != link.next_seq:
            raise ControlError(f"scatter: seq {seq} out of order (expected {link.next_seq})")
        if not 1 <= num_items <= self._items_per_slot or len(payload) != 8 * num_items:
            raise ControlError("scatter: num_items does not match the slot or the payload")
        ids = torch.frombuffer(bytearray(payload), dtype=torch.int64)
        if int(ids.min()) < 0 or int(ids.max()) >= self._items.shape[0]:
            raise ControlError("scatter: item ids outside the pool")
        if torch.unique(ids).numel() != num_items:
            raise ControlError("scatter: repeated item ids")
        link.next_seq += 1
        TIMELINE.mark("scatter_begin", seq=seq, num_items=num_items)
        source = self._staging[slot, : num_items * self._item_bytes].view(num_items, -1)
        if stream is None:
            self._items.index_copy_(0, ids, source)
        else:  # the sender is answered only once the pages hold the bytes (and the slot,
            # host or device, may be written again)
            with torch.cuda.stream(stream):
                device = self._items.device
                source = source.to(device, non_blocking=True)  # host staging: one copy
                self._items.index_copy_(0, ids.to(device, non_blocking=False), source)
            stream.synchronize()
        TIMELINE.mark("scatter_end", seq=seq)

    def _forget(self, link: _Link) -> None:
        with self._lock:
            if link in self._pending:
                self._pending.remove(link)
            if link in self._links:
                self._links.discard(link)
                assert link.peer is not None
                self._peer_links[link.peer] -= 1
                self._peer_slots[link.peer] -= len(link.slots)
                self._peer_links += Counter()  # drops peers at zero
                self._peer_slots += Counter()
            self._leased.difference_update(link.slots)
            for slot in link.slots:
                self._free_after_s[slot] = time.monotonic() + self.limits.quarantine_s
            self._threads.discard(threading.current_thread())

    def num_connections(self) -> tuple[int, int]:
        """(pending, authenticated) connections, for tests and metrics."""
        with self._lock:
            return len(self._pending), len(self._links)

    def close(self) -> None:
        """Stops serving; waits briefly for a scatter under way (the caller unregisters the
        staging region and the pool afterwards)."""
        with self._lock:
            self._closed = True
            links, threads = [*self._pending, *self._links], list(self._threads)
        _shutdown(self._listener)  # wakes the accepting thread
        self._listener.close()
        for link in links:
            _shutdown(link.conn)
        for thread in threads:
            thread.join(2.0)


_SCATTER = {"slot": int, "seq": int, "num_items": int}


def _shutdown(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
