"""The prefill side of coalesced `mooncake` writes: a `StagingLink` (control connection and
leased slots of one decode rank) and `write_coalesced`, which pipelines gather -> large
transfers -> remote scatter through those slots."""

from __future__ import annotations

import secrets
import select
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvstrata.disagg.transport.base import TransferError
from kvstrata.disagg.transport.mooncake_control import (
    ControlError,
    fields,
    hello_mac,
    parse_nonce,
    recv_frame,
    send_frame,
)
from kvstrata.disagg.transport.mooncake_engine import COMPLETED, PENDING
from kvstrata.disagg.transport.mooncake_plan import MAX_TRANSFER_BYTES
from kvstrata.disagg.transport.mooncake_staging import SLOTS_PER_LINK, StagingInfo
from kvstrata.disagg.transport.write_timeline import TIMELINE

_POLL_S = 0.0002


class StagingLink:
    """An authenticated connection to one decode rank's staging server and the slots it
    leased (possibly none: all taken; `lease` asks again). Used by that rank's sender
    worker only. Every answer is checked; anything unexpected raises ControlError."""

    def __init__(self, info: StagingInfo, timeout_s: float, peer: str) -> None:
        self.info = info
        self.slots: list[int] = []
        self._next_seq = 0
        try:
            self.sock = socket.create_connection((info.host, info.port), timeout=timeout_s)
        except OSError as e:
            raise TransferError(f"the staging server {info.host}:{info.port} failed: {e}") from e
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            self._hello(peer)
        except BaseException:
            self.sock.close()
            raise

    def _hello(self, peer: str) -> None:
        """Proves this side holds the endpoint's secret (which never goes on the wire)."""
        challenge = fields(_answer(self.sock), "challenge", {"nonce": str})
        server_nonce, client_nonce = parse_nonce(challenge["nonce"]), secrets.token_hex(32)
        mac = hello_mac(bytes.fromhex(self.info.secret), server_nonce, client_nonce, peer)
        send_frame(self.sock, {"op": "hello", "peer": peer, "nonce": client_nonce, "mac": mac})
        fields(_answer(self.sock), "welcome", {})

    def is_open(self) -> bool:
        """False once the server closed it (idle links are closed): between writes nothing
        is expected, so anything readable is the end of the connection."""
        return not select.select([self.sock], [], [], 0)[0]

    def lease(self) -> bool:
        """Asks for slots if it holds none; True when it holds some."""
        if not self.slots:
            send_frame(self.sock, {"op": "lease", "num_slots": SLOTS_PER_LINK})
            slots = fields(_answer(self.sock), "leased", {"slots": list})["slots"]
            if (
                len(slots) > SLOTS_PER_LINK
                or not all(type(s) is int and s >= 0 for s in slots)
                or len(set(slots)) != len(slots)
            ):
                raise ControlError("leased: slots must be distinct slot indices")
            self.slots = slots
        return bool(self.slots)

    def request_scatter(self, slot_index: int, dst_item_ids: torch.Tensor) -> int:
        """Asks the decode rank to scatter leased slot `slot_index`; its sequence number."""
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        payload = dst_item_ids.numpy().astype("<i8", copy=False).tobytes()
        header = {
            "op": "scatter",
            "slot": self.slots[slot_index],
            "seq": seq,
            "num_items": dst_item_ids.numel(),
        }
        send_frame(self.sock, header, payload)
        return seq

    def answers(self) -> list[int]:
        """The seq of every scatter answered so far, without waiting for more."""
        answered = []
        while select.select([self.sock], [], [], 0)[0]:
            answered.append(fields(_answer(self.sock), "scattered", {"seq": int})["seq"])
        return answered

    def close(self) -> None:
        """The decode rank releases (and quarantines) the slots when the connection ends."""
        self.sock.close()


def _answer(sock: socket.socket) -> dict[str, Any]:
    """The server's next message; its refusal (sent before it closes) as ControlError."""
    header, _ = recv_frame(sock, 0)
    if header.get("op") == "refused":
        raise ControlError(f"the decode rank refused: {str(header.get('error'))[:200]}")
    return header


@dataclass(frozen=True)
class CoalescedWrite:
    """One write's items, ids on the host (`dst_item_ids` are sent to the decode rank):
    item i of the source lands in item i there, read only after `ready` (CUDA: the
    kernels that wrote the source pages)."""

    src_items: torch.Tensor  # [num_items, item_bytes] view of the source pool
    src_item_ids: torch.Tensor
    dst_item_ids: torch.Tensor
    session: str
    ready: torch.cuda.Event | None = None


class Gatherer:
    """Owns one peer worker's local staging slots (`[num_slots, slot_bytes]`, in pinned
    host memory when `on_host`, else beside the pool; the caller registers them) and, on
    CUDA, the stream, item-id buffers and device scratch that fill them, all made once, so
    a gather neither allocates nor copies from pageable memory. A write's item ids uploaded
    from pageable memory stalled its first gather for most of the prefill queued ahead,
    under MPS on one H200 (docs/results.md, issue 17.2).

    Invariant: every device buffer the gatherer's stream touches was allocated on that
    stream. A block allocated on the caller's stream (the compute stream) can be one the
    engine just freed while kernels that still write it are queued: safe for work on that
    stream, not for this one. A 4096-token chunk's positions landed in the item ids that
    way, and the gather indexed out of bounds (issue 29)."""

    def __init__(
        self,
        num_slots: int,
        slot_bytes: int,
        on_host: bool,
        pool_device: torch.device,
        item_bytes: int,
    ) -> None:
        stream = None
        if pool_device.type == "cuda":
            stream = torch.cuda.Stream(pool_device, priority=-1)  # ahead of compute's blocks
        self._stream = stream
        self._scratch: torch.Tensor | None = None
        with torch.cuda.stream(stream):  # None (CPU): no stream to allocate on
            self.slots = torch.empty(
                num_slots,
                slot_bytes,
                dtype=torch.uint8,
                device="cpu" if on_host else pool_device,
                pin_memory=on_host,
            )
            if stream is not None:
                max_items = slot_bytes // item_bytes
                self._ids_host = torch.empty(max_items, dtype=torch.int64, pin_memory=True)
                self._ids = torch.empty(max_items, dtype=torch.int64, device=pool_device)
            if stream is not None and on_host:  # host slots: gathered on the device first
                self._scratch = torch.empty(slot_bytes, dtype=torch.uint8, device=pool_device)

    def begin(self, write: CoalescedWrite) -> None:
        """Orders this write's gathers after the kernels that wrote its pages."""
        if self._stream is not None and write.ready is not None:
            self._stream.wait_event(write.ready)

    def gather(self, write: CoalescedWrite, slot_index: int, first: int, last: int) -> None:
        """Items [first, last) of the write into the front of slot `slot_index`, finished
        on return (the NIC, or tcp's copy, reads the slot next)."""
        num_items = last - first
        num_bytes = num_items * write.src_items.shape[1]
        out = self.slots[slot_index, :num_bytes].view(num_items, -1)
        if self._stream is None:
            torch.index_select(write.src_items, 0, write.src_item_ids[first:last], out=out)
            return
        self._ids_host[:num_items].copy_(write.src_item_ids[first:last])
        with torch.cuda.stream(self._stream):
            ids = self._ids[:num_items]
            ids.copy_(self._ids_host[:num_items], non_blocking=True)
            if self._scratch is None:
                torch.index_select(write.src_items, 0, ids, out=out)
            else:
                on_device = self._scratch[:num_bytes].view(num_items, -1)
                torch.index_select(write.src_items, 0, ids, out=on_device)
                out.copy_(on_device, non_blocking=True)
        self._stream.synchronize()  # the pinned ids and the scratch are reused next


@dataclass
class Progress:
    """What the caller watches: `moved()` on every settled transfer or scatter; the write
    stops when `abandoned()` turns true, handing its in-flight batch ids to `leave`."""

    moved: Callable[[], None]
    abandoned: Callable[[], bool]
    leave: Callable[[list[int]], None]


def write_coalesced(
    engine: Any, link: StagingLink, gatherer: Gatherer, write: CoalescedWrite, progress: Progress
) -> bool:
    """Moves the write's items through the link's slots: each chunk of `items_per_slot`
    items is gathered into local slot i (`gatherer.slots[i]`, registered with `engine`),
    written into the remote slot as transfers of at most MAX_TRANSFER_BYTES, and scattered
    there once they completed; a slot is reused after its scatter is answered. Raises
    TransferError on any failure; False if abandoned. Either way the caller drops the
    link (its slots may hold a chunk in flight)."""
    item_bytes = write.src_items.shape[1]
    items_per_slot = link.info.slot_bytes // item_bytes
    num_items = write.src_item_ids.numel()
    num_chunks = -(-num_items // items_per_slot)
    staging = gatherer.slots
    gatherer.begin(write)
    free = list(range(min(len(link.slots), staging.shape[0])))
    writing: dict[int, tuple[int, list[int]]] = {}  # local slot -> (chunk, batch ids)
    scattering: dict[int, int] = {}  # seq -> local slot
    next_chunk, num_done = 0, 0
    try:
        while num_done < num_chunks:
            if progress.abandoned():
                return False
            busy = False
            while free and next_chunk < num_chunks:
                slot_index, chunk = free.pop(), next_chunk
                next_chunk += 1
                first, last = chunk * items_per_slot, min(num_items, (chunk + 1) * items_per_slot)
                gatherer.gather(write, slot_index, first, last)
                TIMELINE.mark("chunk_gathered", chunk=chunk, num_bytes=(last - first) * item_bytes)
                local_ptr = staging[slot_index].data_ptr()
                remote_ptr = link.info.base_ptr + link.slots[slot_index] * link.info.slot_bytes
                writing[slot_index] = (chunk, [])  # before submitting: failures leave them
                _submit(
                    engine,
                    write.session,
                    local_ptr,
                    remote_ptr,
                    (last - first) * item_bytes,
                    writing[slot_index][1],
                )
            for slot_index, (chunk, batch_ids) in list(writing.items()):
                left, error = _poll(engine, batch_ids)
                writing[slot_index] = (chunk, left)  # settled ids are freed: never polled again
                if error:
                    raise TransferError(f"a transfer to {write.session} failed ({error})")
                if len(left) < len(batch_ids):
                    progress.moved()
                    busy = True
                if not left:
                    TIMELINE.mark("chunk_landed", chunk=chunk)
                    del writing[slot_index]
                    first, last = chunk * items_per_slot, (chunk + 1) * items_per_slot
                    seq = link.request_scatter(slot_index, write.dst_item_ids[first:last])
                    scattering[seq] = slot_index
            for seq in link.answers():
                if seq not in scattering:
                    raise TransferError(f"the decode rank answered an unknown scatter {seq}")
                free.append(scattering.pop(seq))
                TIMELINE.mark("chunk_scattered", seq=seq)
                num_done += 1
                progress.moved()
                busy = True
            if not busy:
                time.sleep(_POLL_S)
        return True
    except (OSError, ControlError) as e:
        raise TransferError(f"the staging link to {write.session} failed: {e}") from e
    finally:  # left in flight (abandoned or failed): the caller settles them later
        progress.leave([b for _, batch_ids in writing.values() for b in batch_ids])


def _submit(
    engine: Any, session: str, local_ptr: int, remote_ptr: int, num_bytes: int, out: list[int]
) -> None:
    """Submits the copy as transfers of at most MAX_TRANSFER_BYTES, their ids into `out`."""
    for offset in range(0, num_bytes, MAX_TRANSFER_BYTES):
        length = min(MAX_TRANSFER_BYTES, num_bytes - offset)
        batch_id = engine.transfer_submit_write(
            session, local_ptr + offset, remote_ptr + offset, length
        )
        if batch_id == 0:
            raise TransferError(f"submitting a transfer to {session} failed")
        out.append(batch_id)


def _poll(engine: Any, batch_ids: list[int]) -> tuple[list[int], str]:
    """The ids still in flight, and what failed ('' if nothing). A completed or failed id
    is freed by its poll; a timed-out one is not and leaks (rare, small)."""
    left, error = [], ""
    for batch_id in batch_ids:
        status = engine.transfer_check_status(batch_id)
        if status == PENDING:
            left.append(batch_id)
        elif status != COMPLETED:
            error = error or f"status {status}"
    return left, error
