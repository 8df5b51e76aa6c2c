"""The `mooncake` transport: one-sided writes of the Mooncake Transfer Engine (tcp or rdma).
The decode rank registers its L1 pool; the prefill rank computes the address of each page
of each layer, K and V, in both pools and writes runs of consecutive pages."""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass
from typing import Any

import torch

from kvstrata.disagg.transport.base import (
    WRITTEN,
    KVReceiver,
    KVSender,
    PendingWrite,
    TransferError,
    check_shapes,
)
from kvstrata.disagg.transport.mooncake_config import FLAG, MooncakeTransportConfig
from kvstrata.disagg.transport.mooncake_plan import PoolRegion, Transfer, plan_transfers
from kvstrata.kvcache.pages import KVPool
from kvstrata.kvcache.storage.blocking import BlockingCaller

log = logging.getLogger("kvstrata.disagg")

# transfer_check_status results (mooncake's TransferEnginePy). COMPLETED and FAILED free
# the batch: its id must never be polled again. TIMED_OUT does not free it.
_PENDING, _COMPLETED, _FAILED, _TIMED_OUT = 0, 1, -1, -2
# The tcp transport queues at most 1024 slices of 64 KiB per peer (plus 1024 waiting up to
# 1 s) and FAILS what overflows instead of waiting: a write keeps at most this much in
# flight (<= 768 slices; transfers are at most 4 MiB, see mooncake_plan.py).
_MAX_INFLIGHT_BYTES = 32 << 20
_MAX_INFLIGHT_TRANSFERS = 256
_POLL_S = 0.0002  # between status polls of in-flight transfers


def _engine_class() -> Any:
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:
        raise RuntimeError(
            "--disaggregation-transfer-backend mooncake needs the Mooncake Transfer Engine: "
            "pip install mooncake-transfer-engine (CUDA) or mooncake-transfer-engine-non-cuda "
            f"(CPU); import failed: {e}"
        ) from e
    return TransferEngine


def _unused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def start_engine(config: MooncakeTransportConfig) -> tuple[Any, str]:
    """A started TransferEngine and its session name (what peers address it by). Never
    blocks for long: P2P start-up is local, and the metadata client gives up after ~3 s."""
    engine_class = _engine_class()
    host = config.local_hostname
    for _attempt in range(2):
        engine = engine_class()
        # With P2PHANDSHAKE the engine names itself host:<its rpc port>. A metadata service
        # keys engines by the name given, so two engines of one host need distinct names:
        # a port number free on this host is (a clash is refused; the retry draws anew).
        name = host if config.uses_p2p_handshake else f"{host}:{_unused_port()}"
        rc = engine.initialize(name, config.metadata_server, config.protocol, config.device_name)
        if rc == 0:
            session = f"{host}:{engine.get_rpc_port()}" if config.uses_p2p_handshake else name
            return engine, session
        del engine
    raise TransferError(
        f"the Mooncake transfer engine did not start (status {rc}) with metadata server "
        f"{config.metadata_server!r}, protocol {config.protocol!r} ({FLAG})"
    )


def _register(engine: Any, data: torch.Tensor) -> tuple[int, int]:
    """Registers the whole pool (one allocation) with the engine; (base_ptr, num_bytes)."""
    if not data.is_contiguous():
        raise ValueError("the mooncake transport needs a contiguous KV pool")
    base_ptr, num_bytes = data.data_ptr(), data.numel() * data.element_size()
    rc = engine.register_memory(base_ptr, num_bytes)
    if rc != 0:
        raise TransferError(f"registering the KV pool ({num_bytes} bytes) failed: status {rc}")
    return base_ptr, num_bytes


class MooncakeReceiver(KVReceiver):
    """Decode side: keeps `pool.data` registered until `close`. Peers may write any page at
    any time while it is registered; which pages they may write is the decode scheduler's
    business (a room's pages stay allocated until prefill can no longer write them)."""

    def __init__(self, pool: KVPool, config_json: str) -> None:
        self.config = MooncakeTransportConfig.from_json(config_json)
        self.pool = pool
        self._engine, session = start_engine(self.config)
        self._base_ptr, _ = _register(self._engine, pool.data)
        self._endpoint: dict[str, Any] = {
            "backend": "mooncake",
            "id": f"mooncake-{session}-{uuid.uuid4().hex[:12]}",
            "session": session,
            "base_ptr": self._base_ptr,
            "shape": list(pool.data.shape),
            "dtype": str(pool.data.dtype),
        }

    def endpoint(self) -> dict[str, Any]:
        if self._engine is None:
            raise TransferError("the mooncake receiver is closed")
        return {**self._endpoint, "shape": list(self._endpoint["shape"])}

    def close(self) -> None:
        """Unregisters the pool (later writes are refused by this side) and stops the
        engine."""
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.unregister_memory(self._base_ptr)


@dataclass
class _Remote:
    session: str
    region: PoolRegion
    probed: bool = False  # set by its worker once the peer answered a probe


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
        self._base_ptr, _ = _register(self._engine, pool.data)
        self._region = PoolRegion.of(pool.data)
        self._workers: dict[str, BlockingCaller] = {}  # by peer session; caller only
        self._remotes: dict[str, _Remote] = {}  # endpoint id -> its peer; caller only
        self._lock = threading.Lock()  # guards the two below (workers change them)
        self._jobs: set[_Job] = set()  # started or queued, not yet ended
        self._unsettled: list[int] = []  # batch ids of abandoned writes
        self._closed = False

    def write(
        self, endpoint: dict[str, Any], src_page_ids: list[int], dst_page_ids: list[int]
    ) -> None:
        pending = self.start(endpoint, src_page_ids, dst_page_ids)
        while not pending.poll():
            time.sleep(0.001)

    def start(
        self, endpoint: dict[str, Any], src_page_ids: list[int], dst_page_ids: list[int]
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
        transfers = plan_transfers(self._region, remote.region, src_page_ids, dst_page_ids)
        if self.pool.data.is_cuda:  # the NIC reads the pool: the kernels writing it are done
            torch.cuda.synchronize(self.pool.data.device)
        job = _Job()
        worker = self._workers.get(remote.session)
        if worker is None:
            worker = BlockingCaller(1, f"kv-mooncake-send-{len(self._workers)}")
            self._workers[remote.session] = worker
        with self._lock:
            self._jobs.add(job)
        future = worker.submit(self._run, job, remote, transfers)
        future.add_done_callback(lambda _: self._end(job))
        return _MooncakeWrite(self, job, future, key)

    def _end(self, job: _Job) -> None:
        with self._lock:
            self._jobs.discard(job)

    def _remote(self, endpoint: dict[str, Any]) -> tuple[str, _Remote]:
        key = endpoint.get("id")
        if key in self._remotes:
            return key, self._remotes[key]
        if endpoint.get("backend") != "mooncake" or not isinstance(key, str):
            raise TransferError(f"not a mooncake endpoint: {sorted(endpoint)}")
        try:
            shape, dtype_name = [int(d) for d in endpoint["shape"]], str(endpoint["dtype"])
            session, base_ptr = str(endpoint["session"]), int(endpoint["base_ptr"])
        except (KeyError, TypeError, ValueError) as e:
            raise TransferError(f"malformed mooncake endpoint {endpoint}: {e!r}") from e
        check_shapes(self.pool, shape, dtype_name)  # so only the page count may differ
        region = PoolRegion(base_ptr, shape[2], self._region.num_planes, self._region.chunk_bytes)
        remote = _Remote(session, region)
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

    def _run(self, job: _Job, remote: _Remote, transfers: list[Transfer]) -> None:
        """On the peer's worker: probes a peer not yet probed, then keeps a bounded window
        of transfers in flight until all settle."""
        job.last_progress_s = time.monotonic()
        session = remote.session
        if not remote.probed:
            job.probing = True
            self._probe(session)
            remote.probed, job.probing = True, False
            job.last_progress_s = time.monotonic()
        engine = self._engine
        self._reap(engine)
        pending: dict[int, int] = {}  # batch id -> bytes
        num_submitted, inflight_bytes = 0, 0
        error = ""
        try:
            while True:
                while (
                    not error and not job.abandoned and num_submitted < len(transfers)
                    and len(pending) < _MAX_INFLIGHT_TRANSFERS
                    and (not pending or inflight_bytes + transfers[num_submitted].num_bytes
                         <= _MAX_INFLIGHT_BYTES)
                ):  # fmt: skip
                    t = transfers[num_submitted]
                    batch_id = engine.transfer_submit_write(
                        session, t.src_ptr, t.dst_ptr, t.num_bytes
                    )
                    if batch_id == 0:  # no segment for the session, or the submit was refused
                        error = f"submitting a transfer to {session} failed"
                        break
                    pending[batch_id] = t.num_bytes
                    inflight_bytes += t.num_bytes
                    num_submitted += 1
                for batch_id in list(pending):
                    status = engine.transfer_check_status(batch_id)
                    if status == _PENDING:
                        continue
                    inflight_bytes -= pending.pop(batch_id)
                    job.last_progress_s = time.monotonic()
                    if status != _COMPLETED:
                        # A _TIMED_OUT batch is not freed by the engine: it leaks (rare, small).
                        error = error or f"a transfer to {session} failed (status {status})"
                if not pending and (error or num_submitted == len(transfers)):
                    break
                if job.abandoned:  # the caller gave up
                    return
                time.sleep(_POLL_S)
        finally:
            with self._lock:
                self._unsettled.extend(pending)  # left in flight: settled by later writes
        if error:
            raise TransferError(error)

    def _reap(self, engine: Any) -> None:
        """Polls transfers of abandoned writes; those that settled are freed by the poll."""
        with self._lock:
            self._unsettled = [
                b for b in self._unsettled if engine.transfer_check_status(b) == _PENDING
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
        if not stopped or self._unsettled:
            log.warning("mooncake sender: transfers still in flight; engine left running")
            return
        engine.unregister_memory(self._base_ptr)
        self._engine = None
