"""PD between tensor-parallel ranks of equal size: worker i of the prefill rank writes its
head slice of each page into worker i of the decode rank. The decode leader's endpoint
carries its followers' endpoints (`tp_slices`, `TPReceiver`); the prefill leader writes its
own slice and has each follower write its own (`TPSender`); a write is in place once
every slice is. A follower's end of the transport is a `WorkerEnd`."""

from __future__ import annotations

import time
from typing import Any, cast

from kvstrata.disagg.transport.base import KVReceiver, KVSender, PendingWrite, TransferError
from kvstrata.disagg.transport.endpoints import Endpoint
from kvstrata.engine.tp_transfer import TPTransfers

WRITE_POLL_S = 0.0005  # a blocking `write` polls its parts this often


class TPReceiver(KVReceiver):
    """The decode leader's receiver: its own pool's endpoint, with every follower's."""

    def __init__(self, inner: KVReceiver, tp: TPTransfers) -> None:
        if len(tp.endpoints) != tp.size - 1:
            raise RuntimeError(f"{len(tp.endpoints)} follower endpoints for {tp.size} workers")
        self.inner, self.tp = inner, tp

    def endpoint(self) -> Endpoint:
        endpoint = self.inner.endpoint()
        endpoint["tp_size"] = self.tp.size
        endpoint["tp_slices"] = [dict(e) for e in self.tp.endpoints]
        return endpoint

    def close(self) -> None:
        self.inner.close()  # the followers' at their Stop


class _GroupWrite:
    """A `PendingWrite` of every worker's slice: in place once all are; a failure of any
    is raised only once none is in flight any more (the pages stay put until then)."""

    def __init__(self, leader: PendingWrite, tp: TPTransfers, write_id: int) -> None:
        self.leader, self.tp, self.write_id = leader, tp, write_id
        self.leader_done = False
        self.followers_done = False
        self.error: str | None = None

    def poll(self) -> bool:
        if not self.leader_done:
            try:
                self.leader_done = self.leader.poll()
            except TransferError as e:
                self.leader_done, self.error = True, self.error or str(e)
        if not self.followers_done:
            outcome = self.tp.outcome(self.write_id)
            if outcome is not None:
                self.followers_done, self.error = True, self.error or outcome.error
        if not (self.leader_done and self.followers_done):
            return False
        if self.error is not None:
            raise TransferError(self.error)
        return True


class TPSender(KVSender):
    """The prefill leader's sender: `inner` writes the leader's slice, the followers
    theirs, each to its matching decode worker (the endpoint's `tp_slices`)."""

    def __init__(self, inner: KVSender, tp: TPTransfers) -> None:
        super().__init__(inner.pool)
        self.inner, self.tp = inner, tp

    @property
    def page_bytes(self) -> int:
        return self.inner.page_bytes * self.tp.size

    def start(
        self, endpoint: Endpoint, src_page_ids: list[int], dst_page_ids: list[int]
    ) -> PendingWrite:
        slices = cast(list[dict[str, Any]], endpoint.get("tp_slices", []))
        if endpoint.get("tp_size", 1) != self.tp.size or len(slices) != self.tp.size - 1:
            raise TransferError(
                f"the decode endpoint has {len(slices) + 1} tensor-parallel slices, this "
                f"rank {self.tp.size}"
            )
        # The leader's first: if it is refused up front, no follower has started a write.
        leader = self.inner.start(endpoint, src_page_ids, dst_page_ids)
        return _GroupWrite(leader, self.tp, self.tp.start(slices, src_page_ids, dst_page_ids))

    def write(self, endpoint: Endpoint, src_page_ids: list[int], dst_page_ids: list[int]) -> None:
        pending = self.start(endpoint, src_page_ids, dst_page_ids)
        while not pending.poll():
            time.sleep(WRITE_POLL_S)

    def close(self) -> None:
        self.inner.close()


class WorkerEnd:
    """A follower's end (`engine.tp_transfer.WorkerTransfer`): the receiver of its pool
    slice on a decode rank, its sender on a prefill rank."""

    def __init__(self, receiver: KVReceiver | None, sender: KVSender | None) -> None:
        self.receiver, self.sender = receiver, sender

    def endpoint(self) -> dict[str, Any] | None:
        return None if self.receiver is None else dict(self.receiver.endpoint())

    def start(
        self, endpoint: dict[str, Any], src_page_ids: list[int], dst_page_ids: list[int]
    ) -> PendingWrite:
        if self.sender is None:
            raise TransferError("this worker sends nothing: its rank is not a prefill rank")
        return self.sender.start(cast(Endpoint, endpoint), src_page_ids, dst_page_ids)

    def close(self) -> None:
        for end in (self.sender, self.receiver):
            if end is not None:
                end.close()
