"""The `mooncake` transport: one-sided writes of the Mooncake Transfer Engine (tcp or rdma).
The decode rank (mooncake_receiver.py) registers its L1 pool and a staging region; the
prefill rank here writes runs of pages consecutive in both pools, or coalesces scattered
pages through the staging region (mooncake_coalesce.py)."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass
from typing import Any

import torch

from kvstrata.config.mooncake import MooncakeTransportConfig
from kvstrata.disagg.transport.base import (
    WRITTEN,
    KVSender,
    PendingWrite,
    TransferError,
    check_shapes,
)
from kvstrata.disagg.transport.endpoints import Endpoint
from kvstrata.disagg.transport.mooncake_coalesce import (
    CoalescedWrite,
    Gatherer,
    Progress,
    StagingLink,
    write_coalesced,
)
from kvstrata.disagg.transport.mooncake_control import ControlError
from kvstrata.disagg.transport.mooncake_engine import PENDING, register, start_engine
from kvstrata.disagg.transport.mooncake_plain import write_polled
from kvstrata.disagg.transport.mooncake_plan import (
    PoolRegion,
    plan_items,
    plan_transfers,
    worth_coalescing,
)
from kvstrata.disagg.transport.mooncake_receiver import MooncakeReceiver
from kvstrata.disagg.transport.mooncake_staging import (
    SLOTS_PER_LINK,
    StagingInfo,
    pool_items,
)
from kvstrata.disagg.transport.write_timeline import TIMELINE
from kvstrata.kvcache.pages import KVPool
from kvstrata.kvcache.storage.blocking import BlockingCaller

__all__ = ["MooncakeReceiver", "MooncakeSender", "start_engine"]

log = logging.getLogger("kvstrata.disagg")


@dataclass
class _Remote:
    session: str
    region: PoolRegion
    staging: StagingInfo | None  # None: the peer does not coalesce
    probed: bool = False  # set by its worker once the peer answered a probe
    link: StagingLink | None = None  # its worker's control connection, once opened


class _Job:
    """One write on its peer's worker. `last_progress_s` is set when the worker starts it
    and moves when the probe answers and whenever a transfer settles; the caller gives up
    (sets `abandoned`) once it has not moved for `timeout_s`, or the job waited in the
    queue twice that long (behind writes into a stopped peer)."""

    def __init__(self) -> None:
        self.queued_s = time.monotonic()
        self.last_progress_s: float | None = None  # None: still queued
        self.probing = False  # waiting for a probe, which gives up by itself
        self.abandoned = False


class _MooncakeWrite:
    """A `PendingWrite`: a job on the sender's worker, judged on each poll."""

    def __init__(self, sender: MooncakeSender, job: _Job, future: Future[None], key: str) -> None:
        self.sender, self.job, self.future, self.key = sender, job, future, key

    def poll(self) -> bool:
        if self.future.done():
            try:
                self.future.result()
            except CancelledError:
                raise TransferError("the write was dropped before it started") from None
            except TransferError:
                self.sender._remotes.pop(self.key, None)  # probed again before its next write
                raise
            return True
        job, timeout_s = self.job, self.sender.config.timeout_s
        now_s = time.monotonic()
        if job.last_progress_s is None:
            stuck = now_s - job.queued_s >= 2 * timeout_s
        else:  # a probe gives up after timeout_s itself, with the clearer error
            patience_s = 2 * timeout_s if job.probing else timeout_s
            stuck = now_s - job.last_progress_s >= patience_s
        if not stuck:
            return False
        job.abandoned = True
        self.future.cancel()  # drops it if it is still queued behind a stuck write
        self.sender._remotes.pop(self.key, None)
        raise TransferError(
            f"no transfer finished within {timeout_s:g} s (decode rank dead or frozen)"
        )


class MooncakeSender(KVSender):
    """Prefill side. Invariants: every engine call that can wait on a peer runs off the
    caller's thread, on a worker of that peer's own (probes on a daemon thread it waits
    for), so `start` never waits on a peer, a stopped peer delays only writes into itself,
    and a write's poll gives up once it made no progress for `timeout_s` (or sat queued
    for twice that); a batch id is polled only until it settles (settling frees it); the
    engine and the pool registration outlive every transfer that may still read the pool."""

    def __init__(self, pool: KVPool, config_json: str) -> None:
        super().__init__(pool)
        self.config = MooncakeTransportConfig.from_json(config_json)
        self._engine, _ = start_engine(self.config)
        self._base_ptr = register(self._engine, pool.data)
        self._region = PoolRegion.of(pool.data)
        self._items = pool_items(pool.data)
        # Local staging slots by (peer session, slot bytes): used by that peer's worker only,
        # registered until close (an abandoned write's transfers may still read them).
        self._staging: dict[tuple[str, int], Gatherer] = {}
        self._last_ready: torch.cuda.Event | None = None  # the caller's last write's event
        self.num_writes = {"coalesced": 0, "plain": 0}  # by the path taken (tests, benches)
        self._peer = f"sender-{uuid.uuid4().hex[:16]}"  # this sender's name to staging servers
        self._workers: dict[str, BlockingCaller] = {}  # by peer session; caller only
        self._remotes: dict[str, _Remote] = {}  # endpoint id -> its peer; caller only
        self._lock = threading.Lock()  # guards the two below (workers change them)
        self._jobs: set[_Job] = set()  # started or queued, not yet ended
        self._unsettled: list[int] = []  # batch ids of abandoned writes
        self._closed = False

    def write(self, endpoint: Endpoint, src_page_ids: list[int], dst_page_ids: list[int]) -> None:
        pending = self.start(endpoint, src_page_ids, dst_page_ids)
        while not pending.poll():
            time.sleep(0.001)

    def start(
        self, endpoint: Endpoint, src_page_ids: list[int], dst_page_ids: list[int]
    ) -> PendingWrite:
        """Checks the write and hands it to its peer's worker (which probes a peer before
        its first write)."""
        if self._closed:
            raise TransferError("the mooncake sender is closed")
        if len(src_page_ids) != len(dst_page_ids):
            raise TransferError(f"{len(src_page_ids)} source pages for {len(dst_page_ids)} slots")
        if not src_page_ids:
            return WRITTEN
        if len(set(dst_page_ids)) != len(dst_page_ids):
            raise TransferError(f"destination pages {dst_page_ids} repeat a page")
        if min(src_page_ids) < 0 or max(src_page_ids) >= self.pool.num_pages:
            raise TransferError(f"source pages {src_page_ids} outside the local pool")
        key, remote = self._remote(endpoint)
        if min(dst_page_ids) < 0 or max(dst_page_ids) >= remote.region.num_pages:
            raise TransferError(f"destination pages {dst_page_ids} outside the remote pool")
        TIMELINE.mark("write_start", num_pages=len(src_page_ids))
        ready = None
        if self.pool.data.is_cuda:  # what wrote these pages is ordered before the caller's
            # current stream's tail (the engine's compute stream: loads are ordered before
            # the compute that reads them); the worker waits for it, never this thread
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.pool.data.device))
            # Bounded run-ahead: the caller stays at most one write's kernels ahead of
            # the device (waiting here with the GIL released), so the queue a worker's
            # gathers land behind stays one chunk deep and the caller does not hold the
            # GIL in launches blocked on a full CUDA queue. Measured in the tree that met
            # the 17.2 bound; not ablated alone (docs/results.md). Two writes started in
            # one step make the second wait for that step's kernels, as the device-wide
            # synchronize before it did for every write.
            if self._last_ready is not None:
                self._last_ready.synchronize()
            self._last_ready = ready
        job = _Job()
        worker = self._workers.get(remote.session)
        if worker is None:
            worker = BlockingCaller(1, f"kv-mooncake-send-{len(self._workers)}")
            self._workers[remote.session] = worker
        with self._lock:
            self._jobs.add(job)
        future = worker.submit(
            self._run, job, remote, list(src_page_ids), list(dst_page_ids), ready
        )
        future.add_done_callback(lambda _: self._end(job))
        return _MooncakeWrite(self, job, future, key)

    def _end(self, job: _Job) -> None:
        with self._lock:
            self._jobs.discard(job)

    def _remote(self, endpoint: Endpoint) -> tuple[str, _Remote]:
        key = endpoint.get("id")
        if key in self._remotes:
            return key, self._remotes[key]
        if endpoint.get("backend") != "mooncake" or not isinstance(key, str):
            raise TransferError(f"not a mooncake endpoint: {sorted(endpoint)}")
        if "session" not in endpoint:  # never echo the endpoint: its secret
            raise TransferError("malformed mooncake endpoint: it names no session")
        try:
            shape, dtype_name = [int(d) for d in endpoint["shape"]], str(endpoint["dtype"])
            session, base_ptr = str(endpoint["session"]), int(endpoint["base_ptr"])
            staging_json = endpoint.get("staging")
            staging = None if staging_json is None else StagingInfo.from_json(staging_json)
        except (KeyError, TypeError, ValueError) as e:  # never echo the endpoint: its secret
            raise TransferError(f"malformed mooncake endpoint: {e!r}") from e
        check_shapes(self.pool, shape, dtype_name)  # so only the page count may differ
        region = PoolRegion(base_ptr, shape[2], self._region.num_planes, self._region.chunk_bytes)
        remote = _Remote(session, region, staging)
        self._remotes[key] = remote
        return key, remote

    def _probe(self, session: str) -> None:
        """First contact, bounded. A frozen peer never answers and the engine has no timeout
        for that (a write would open the peer's segment under the engine's lock, stalling
        writes to every peer for a minute); a probe holds no lock, and runs on a daemon
        thread that may outlive this call."""
        answer: list[int] = []
        engine = self._engine
        thread = threading.Thread(
            target=lambda: answer.append(engine.send_probe(session)),
            name="kv-mooncake-probe",
            daemon=True,
        )
        thread.start()
        thread.join(self.config.timeout_s)
        if not answer:
            raise TransferError(
                f"decode rank {session} did not answer within {self.config.timeout_s:g} s"
            )
        if answer[0] != 0:
            raise TransferError(f"decode rank {session} is unreachable (status {answer[0]})")

    def _run(
        self,
        job: _Job,
        remote: _Remote,
        src_page_ids: list[int],
        dst_page_ids: list[int],
        ready: torch.cuda.Event | None,
    ) -> None:
        """On the peer's worker: probes a peer not yet probed, then writes coalesced if the
        peer has staging and the plain plan's transfers would be small, else plainly; the
        pages are read only after `ready` (the kernels that wrote them)."""
        job.last_progress_s = time.monotonic()
        TIMELINE.mark("write_run", num_pages=len(src_page_ids))
        if not remote.probed:
            job.probing = True
            self._probe(remote.session)
            remote.probed, job.probing = True, False
            job.last_progress_s = time.monotonic()
        self._reap(self._engine)
        chunk_bytes = self._region.chunk_bytes
        if (
            self.config.coalesce
            and remote.staging is not None
            and chunk_bytes <= remote.staging.slot_bytes
            and (
                remote.staging.every_write
                or worth_coalescing(chunk_bytes, src_page_ids, dst_page_ids)
            )
            and self._write_coalesced(job, remote, src_page_ids, dst_page_ids, ready)
        ):
            TIMELINE.mark("write_done", path="coalesced")
            return
        if ready is not None:  # the NIC (or tcp's copy) reads the pool itself
            ready.synchronize()
            TIMELINE.mark("write_synced")
        self.num_writes["plain"] += 1
        transfers = plan_transfers(self._region, remote.region, src_page_ids, dst_page_ids)
        write_polled(self._engine, remote.session, transfers, self._progress(job))
        TIMELINE.mark("write_done", path="plain")

    def _write_coalesced(
        self,
        job: _Job,
        remote: _Remote,
        src_page_ids: list[int],
        dst_page_ids: list[int],
        ready: torch.cuda.Event | None,
    ) -> bool:
        """Through the peer's staging slots; False (nothing written) if it has none free."""
        assert remote.staging is not None
        if remote.link is not None and not remote.link.is_open():
            self._drop_link(remote)  # the server closed it (idle): open a new one
        try:
            if remote.link is None:
                remote.link = StagingLink(remote.staging, self.config.timeout_s, self._peer)
            if not remote.link.lease():
                return False
        except (OSError, ControlError) as e:
            self._drop_link(remote)
            raise TransferError(f"the staging server of {remote.session} failed: {e}") from e
        self.num_writes["coalesced"] += 1
        slot_bytes = remote.staging.slot_bytes
        gatherer = self._staging.get((remote.session, slot_bytes))
        if gatherer is None:  # host staging: the tcp io thread then copies no GPU memory
            on_host = self.pool.data.is_cuda and self.config.host_staging_for(True)
            gatherer = Gatherer(
                SLOTS_PER_LINK, slot_bytes, on_host, self.pool.data.device, self._items.shape[1]
            )
            register(self._engine, gatherer.slots, "a staging buffer")
            self._staging[(remote.session, slot_bytes)] = gatherer
        src_item_ids, dst_item_ids = plan_items(
            self._region, remote.region, src_page_ids, dst_page_ids
        )
        TIMELINE.mark("write_leased")
        write = CoalescedWrite(self._items, src_item_ids, dst_item_ids, remote.session, ready)
        try:
            finished = write_coalesced(
                self._engine, remote.link, gatherer, write, self._progress(job)
            )
        except TransferError:
            self._drop_link(remote)
            raise
        if not finished:  # abandoned: its slots may still hold a chunk in flight
            self._drop_link(remote)
        return True

    def _progress(self, job: _Job) -> Progress:
        return Progress(
            moved=lambda: setattr(job, "last_progress_s", time.monotonic()),
            abandoned=lambda: job.abandoned,
            leave=self._leave,
        )

    @staticmethod
    def _drop_link(remote: _Remote) -> None:
        link, remote.link = remote.link, None
        if link is not None:
            link.close()

    def _leave(self, batch_ids: list[int]) -> None:
        with self._lock:
            self._unsettled.extend(batch_ids)  # settled by later writes (or close)

    def _reap(self, engine: Any) -> None:
        """Polls transfers of abandoned writes; those that settled are freed by the poll."""
        with self._lock:
            self._unsettled = [
                b for b in self._unsettled if engine.transfer_check_status(b) == PENDING
            ]

    def close(self) -> None:
        """Stops the engine once no transfer can still read the pool: writes still running
        are given up, their workers stopped, and what they left in flight waited for. If
        some stay stuck (a frozen peer), the engine is left running, registered, rather
        than freed under them. Later writes raise TransferError."""
        if self._closed:
            return
        self._closed = True
        engine = self._engine
        timeout_s = self.config.timeout_s
        with self._lock:
            for job in self._jobs:
                job.abandoned = True  # a running write stops and hands back its ids
        stopped = all(worker.shutdown(wait_s=timeout_s) for worker in self._workers.values())
        deadline_s = time.monotonic() + timeout_s
        self._reap(engine)
        while self._unsettled and time.monotonic() < deadline_s:
            time.sleep(0.01)
            self._reap(engine)
        for remote in self._remotes.values():
            self._drop_link(remote)
        if not stopped or self._unsettled:
            log.warning("mooncake sender: transfers still in flight; engine left running")
            return
        for gatherer in self._staging.values():
            engine.unregister_memory(gatherer.slots.data_ptr())
        engine.unregister_memory(self._base_ptr)
        self._engine = None
