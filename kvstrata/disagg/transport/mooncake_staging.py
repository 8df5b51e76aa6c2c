"""The decode side of coalesced `mooncake` writes: a registered staging region of slots that
senders lease over a small TCP control channel, write large transfers into, and ask this
rank to scatter into its pool's pages; the scatter's answer is what settles their write."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger("kvstrata.disagg")

SLOTS_PER_LINK = 4  # slots one sender leases: 4 x 8 MiB keeps 32 MiB on the wire
_HEADER = struct.Struct("<II")  # header JSON bytes, payload bytes
_MAX_HEADER_BYTES = 1 << 16


class ControlError(RuntimeError):
    """The control channel broke or carried something malformed."""


def send_frame(sock: socket.socket, header: dict[str, Any], payload: bytes = b"") -> None:
    """One message: a JSON header and raw bytes (int64 item ids for a scatter)."""
    head = json.dumps(header).encode()
    sock.sendall(_HEADER.pack(len(head), len(payload)) + head + payload)


def recv_frame(sock: socket.socket, max_payload_bytes: int) -> tuple[dict[str, Any], bytes]:
    head_bytes, payload_bytes = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if head_bytes > _MAX_HEADER_BYTES or payload_bytes > max_payload_bytes:
        raise ControlError(f"oversized control frame ({head_bytes} + {payload_bytes} bytes)")
    try:
        header = json.loads(_recv_exact(sock, head_bytes))
    except json.JSONDecodeError as e:
        raise ControlError(f"malformed control header: {e}") from None
    if not isinstance(header, dict):
        raise ControlError(f"control header is not an object: {header!r}")
    return header, _recv_exact(sock, payload_bytes)


def _recv_exact(sock: socket.socket, num_bytes: int) -> bytes:
    chunks, left = [], num_bytes
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ControlError("the control connection closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def pool_items(data: torch.Tensor) -> torch.Tensor:
    """A `[num_layers, 2, num_pages, ...]` pool as `[num_planes * num_pages, chunk_bytes]`
    bytes: item `plane * num_pages + page` is one page of one plane (no copy)."""
    num_items = data.shape[0] * data.shape[1] * data.shape[2]
    return data.view(-1).view(torch.uint8).view(num_items, -1)


@dataclass(frozen=True)
class StagingInfo:
    """What a sender needs to use a decode rank's staging region (part of its endpoint)."""

    host: str
    port: int
    base_ptr: int
    slot_bytes: int

    def to_json(self) -> dict[str, Any]:
        return {"host": self.host, "port": self.port, "base_ptr": self.base_ptr,
                "slot_bytes": self.slot_bytes}  # fmt: skip

    @staticmethod
    def from_json(value: Any) -> StagingInfo:
        """Raises ValueError for a malformed description."""
        if not isinstance(value, dict):
            raise ValueError(f"staging is not an object: {value!r}")
        return StagingInfo(str(value["host"]), int(value["port"]), int(value["base_ptr"]),
                           int(value["slot_bytes"]))  # fmt: skip


class StagingServer:
    """Owns `staging` (`[num_slots, slot_bytes]` bytes on the pool's device, registered by
    the caller) and the control socket. Invariants: a slot is leased to one connection at a
    time and scattered only on that connection's request, which comes after the sender saw
    its transfers complete (Mooncake >= 0.3.12 reports a tcp write complete once applied at
    the destination); a slot a connection left is leasable again only after `quarantine_s`,
    so bytes of an abandoned write still on the wire cannot land in another sender's data."""

    def __init__(
        self, pool_data: torch.Tensor, staging: torch.Tensor, host: str, quarantine_s: float
    ) -> None:
        self._items = pool_items(pool_data)
        self._staging = staging
        self._item_bytes = self._items.shape[1]
        self._quarantine_s = quarantine_s
        self._lock = threading.Lock()  # guards the two below
        self._free_after_s = [0.0] * staging.shape[0]  # leasable from then on
        self._leased: set[int] = set()
        self._connections: set[socket.socket] = set()
        self._closed = False
        self._listener = socket.create_server((host, 0))
        self.port = self._listener.getsockname()[1]
        self._threads = [threading.Thread(target=self._accept, name="kv-staging", daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # closed
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._connections.add(conn)
                thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
                self._threads.append(thread)
            thread.start()

    def _lease(self, num_slots: int) -> list[int]:
        now_s = time.monotonic()
        with self._lock:
            free = [s for s, t in enumerate(self._free_after_s)
                    if s not in self._leased and t <= now_s]  # fmt: skip
            slots = free[:num_slots]
            self._leased.update(slots)
        return slots

    def _serve(self, conn: socket.socket) -> None:
        """One sender: `lease`, then `scatter` requests, each answered once its pages hold
        the slot's bytes; the lease ends with the connection."""
        slots: list[int] = []
        stream = torch.cuda.Stream(self._staging.device) if self._staging.is_cuda else None
        max_payload_bytes = 8 * (self._staging.shape[1] // self._item_bytes)
        try:
            while True:
                header, payload = recv_frame(conn, max_payload_bytes)
                op = header.get("op")
                if op == "lease" and not slots:
                    slots = self._lease(min(int(header.get("num_slots", 1)), SLOTS_PER_LINK))
                    send_frame(conn, {"slots": slots})
                elif op == "scatter":
                    error = self._scatter(slots, header, payload, stream)
                    send_frame(conn, {"seq": header.get("seq"), "error": error})
                else:
                    raise ControlError(f"unexpected control message {header!r}")
        except (OSError, ControlError, ValueError) as e:
            if not isinstance(e, ControlError) or "closed" not in str(e):
                log.warning("mooncake staging: dropping a sender's connection: %s", e)
        finally:
            conn.close()
            with self._lock:
                self._connections.discard(conn)
                self._leased.difference_update(slots)
                for slot in slots:
                    self._free_after_s[slot] = time.monotonic() + self._quarantine_s

    def _scatter(
        self,
        slots: list[int],
        header: dict[str, Any],
        payload: bytes,
        stream: torch.cuda.Stream | None,
    ) -> str:
        """Copies item i of `slot` into pool item `ids[i]`; an error message, or ''."""
        slot, num_items = header.get("slot"), len(payload) // 8
        if slot not in slots:
            return f"slot {slot} is not leased to this sender"
        if num_items * 8 != len(payload) or num_items * self._item_bytes > self._staging.shape[1]:
            return f"{len(payload)} bytes of item ids do not fit a slot"
        ids = torch.frombuffer(bytearray(payload), dtype=torch.int64)
        if num_items and (int(ids.min()) < 0 or int(ids.max()) >= self._items.shape[0]):
            return "item ids outside the pool"
        source = self._staging[slot, : num_items * self._item_bytes].view(num_items, -1)
        if stream is None:
            self._items.index_copy_(0, ids, source)
        else:  # the sender is answered only once the pages hold the bytes
            with torch.cuda.stream(stream):
                self._items.index_copy_(0, ids.to(self._items.device, non_blocking=False), source)
            stream.synchronize()
        return ""

    def close(self) -> None:
        """Stops serving; waits briefly for a scatter under way (the caller unregisters the
        staging region and the pool afterwards)."""
        with self._lock:
            self._closed = True
            connections, threads = list(self._connections), list(self._threads)
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
        self._listener.close()
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        for thread in threads:
            thread.join(2.0)
