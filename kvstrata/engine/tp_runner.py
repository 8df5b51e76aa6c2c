"""The leader of a tensor-parallel rank: it starts the follower processes (`TPWorkers`)
and runs the model through `TPRunner`, which broadcasts each step's inputs before running
the step on its own shard, so every worker runs the same steps in the same order."""

from __future__ import annotations

import contextlib
import multiprocessing
import threading
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING

import torch

from kvstrata.config import ConfigError, EngineConfig
from kvstrata.engine.runner import ModelRunner, build_step_inputs, decode_step_inputs
from kvstrata.engine.tp_follower import (
    INIT_TIMEOUT_S,
    TP_HOST,
    CopyPages,
    L3Clear,
    L3Read,
    L3ReadDone,
    L3Write,
    Logits,
    RunDecode,
    RunStep,
    Stop,
    WorkerInit,
    follower_main,
)
from kvstrata.kvcache.copier import Copier
from kvstrata.kvcache.l3_io import L3IO, L3Job, L3Port
from kvstrata.model.tp import TPGroup, leader_store

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from kvstrata.core import Batch, ScheduledRequest
    from kvstrata.engine.role import RoleFactory
    from kvstrata.engine.runner import PromptRows

STOP_WAIT_S = 10.0


class WorkerLost(RuntimeError):
    """A follower process of this rank exited: the rank cannot run another step."""


def check_devices(config: EngineConfig, device: torch.device) -> None:
    """Refuse a group that needs more CUDA devices than there are (a model that does not
    divide is refused by the shard: `Shard.check`)."""
    size = config.model.tp_size
    if device.type == "cuda":
        first = device.index or 0
        if first + size > torch.cuda.device_count():
            raise ConfigError(
                f"--tp-size {size} from --device {device}: needs CUDA devices {first}.."
                f"{first + size - 1}, {torch.cuda.device_count()} present"
            )


class TPWorkers:
    """The follower processes of one rank and the group they share with the leader."""

    def __init__(self, config: EngineConfig, device: torch.device, roles: RoleFactory) -> None:
        check_devices(config, device)
        size = config.model.tp_size
        store = leader_store(TP_HOST, size, INIT_TIMEOUT_S)
        port = store.port
        context = multiprocessing.get_context("spawn")  # never fork: torch runs here
        # Each follower's PD write outcomes (tp_transfer.FollowerWrites), read by the leader.
        self.reports: list[Connection] = []
        self._closing = False  # set by `close`: followers leaving then are not lost
        self.procs: list[BaseProcess] = []
        for rank in range(1, size):
            reports, follower_end = context.Pipe(duplex=False)
            self.reports.append(reports)
            proc = context.Process(
                target=follower_main,
                args=(config, device, rank, port, roles, follower_end),
                name=f"kvstrata-tp{rank}",
                daemon=True,
            )
            proc.start()
            follower_end.close()  # the follower's copy is its own now
            self.procs.append(proc)
        self.group = TPGroup(store, 0, size, device, INIT_TIMEOUT_S)

    def start_serving(self, init: WorkerInit) -> None:
        """Tell the followers the pool's shape (they build their parts on it)."""
        self.send(init)

    def ready(self) -> None:
        """Wait for every follower to have built its parts (CUDA graphs included)."""
        self.send(None)

    def send(self, command: object) -> None:  # a Command, WorkerInit, Calibrate or None
        self.check_alive()
        self.group.broadcast_object(command)

    def watch(self, on_lost: Callable[[Exception], None]) -> None:
        """Call `on_lost` with a WorkerLost, on a watch thread, once a follower exits
        before `close` (waiting on the processes' sentinels: nothing is reaped there)."""

        def run() -> None:
            (gone, *_) = wait([proc.sentinel for proc in self.procs])
            if self._closing:
                return
            proc = next(p for p in self.procs if p.sentinel == gone)
            on_lost(
                WorkerLost(
                    f"tensor-parallel worker {proc.name} (pid {proc.pid}) exited: this "
                    "rank cannot run a step"
                )
            )

        threading.Thread(target=run, name="kvstrata-tp-watch", daemon=True).start()

    def lost(self) -> str | None:
        """What says a follower exited, or None while all live."""
        for proc in self.procs:
            if not proc.is_alive():
                return (
                    f"tensor-parallel worker {proc.name} (pid {proc.pid}) exited with code "
                    f"{proc.exitcode}: this rank cannot run a step"
                )
        return None

    def check_alive(self) -> None:
        message = self.lost()
        if message is not None:
            raise WorkerLost(message)

    def close(self) -> None:
        """Stop the followers (ask, then terminate those that do not leave)."""
        self._closing = True
        with contextlib.suppress(WorkerLost, RuntimeError):  # then terminated below
            self.send(Stop())
        for proc in self.procs:
            proc.join(STOP_WAIT_S)
            if proc.is_alive():
                proc.terminate()
                proc.join(STOP_WAIT_S)
        self.group.close()
        for reports in self.reports:
            reports.close()


class TPCopier:
    """The leader's L1 <-> L2 copier: each call goes to the followers (which make it on
    their own slices, in the same order as the steps around it), then to `inner`. The
    host fence is the leader's alone: each follower's L3 writes wait on its own."""

    def __init__(self, inner: Copier, workers: TPWorkers) -> None:
        self.inner = inner
        self.workers = workers
        self.backup_stats = inner.backup_stats
        self.load_back_stats = inner.load_back_stats

    def backup(self, l1_page_ids: list[int], host_page_ids: list[int]) -> None:
        self.workers.send(CopyPages("backup", list(l1_page_ids), list(host_page_ids)))
        self.inner.backup(l1_page_ids, host_page_ids)

    def load_back(self, host_page_ids: list[int], l1_page_ids: list[int]) -> None:
        self.workers.send(CopyPages("load_back", list(host_page_ids), list(l1_page_ids)))
        self.inner.load_back(host_page_ids, l1_page_ids)

    def fence_loads(self) -> None:
        self.workers.send(CopyPages("fence_loads", [], []))
        self.inner.fence_loads()

    def fence_l1(self) -> None:
        self.workers.send(CopyPages("fence_l1", [], []))
        self.inner.fence_l1()

    def host_fence(self) -> Callable[[], None]:
        return self.inner.host_fence()


class _GroupCount(Future[int]):
    """A leader's L3 read count that is final only once every worker agreed on it: done
    when the leader's read is; its result, asked for on the engine thread when the cache
    collects the read, is the smallest count of any worker (a page is in L2 only if
    every slice of it arrived)."""

    def __init__(self, leader: Future[int], workers: TPWorkers, job_id: int) -> None:
        super().__init__()
        self.leader, self.workers, self.job_id = leader, workers, job_id

    def done(self) -> bool:
        return self.leader.done()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self.leader.exception(timeout)

    def result(self, timeout: float | None = None) -> int:
        if not super().done():
            count = self.leader.result(timeout)
            self.workers.send(L3ReadDone(self.job_id))
            self.set_result(self.workers.group.min_over_group(count))
        return super().result()


class TPL3:
    """The leader's L3: each read, write and clear goes to the followers (on their own
    slices and L3 threads), then to `inner`, the leader's slice."""

    def __init__(self, inner: L3IO, workers: TPWorkers) -> None:
        self.inner, self.workers = inner, workers
        self.backend = inner.backend
        self._next_job_id = 0

    def read(self, page_hashes: list[bytes], host_page_ids: list[int]) -> L3Job:
        job_id, self._next_job_id = self._next_job_id, self._next_job_id + 1
        self.workers.send(L3Read(job_id, list(page_hashes), list(host_page_ids)))
        job = self.inner.read(page_hashes, host_page_ids)
        job.future = _GroupCount(job.future, self.workers, job_id)
        return job

    def write(
        self,
        page_hashes: list[bytes],
        host_page_ids: list[int],
        ready: Callable[[], None] | None = None,
    ) -> L3Job:
        self.workers.send(L3Write(list(page_hashes), list(host_page_ids)))
        return self.inner.write(page_hashes, host_page_ids, ready)

    def clear(self) -> int:
        self.workers.send(L3Clear())
        return self.inner.clear()

    def shutdown(self) -> None:
        self.inner.shutdown()  # the followers' at their Stop


class TPWrap:
    """The cache wrappers of a TP rank's leader (`make_tiered_cache`'s `wrap`)."""

    def __init__(self, workers: TPWorkers) -> None:
        self.workers = workers

    def copier(self, inner: Copier) -> Copier:
        return TPCopier(inner, self.workers)

    def l3(self, inner: L3IO) -> L3Port:
        return TPL3(inner, self.workers)


class TPRunner:
    """`ModelRunner`'s interface for a TP rank's leader: each call is broadcast to the
    followers, then run on the leader's own shard (`local`)."""

    def __init__(self, local: ModelRunner, workers: TPWorkers) -> None:
        self.local = local
        self.workers = workers
        self.page_size = local.page_size

    def run(self, batch: Batch) -> torch.Tensor:
        step = build_step_inputs(batch, self.page_size)
        self.workers.send(RunStep(step))
        return self.local.run_step(step)

    def run_with_prompt_rows(self, batch: Batch) -> tuple[torch.Tensor, list[PromptRows]]:
        # The followers' `run_step` of the same step: the same forward and sampled rows.
        self.workers.send(RunStep(build_step_inputs(batch, self.page_size)))
        return self.local.run_with_prompt_rows(batch)

    def logits_of(self, hidden: torch.Tensor) -> torch.Tensor:
        self.workers.send(Logits(tuple(hidden.shape), hidden.dtype))
        self.workers.group.broadcast_tensor(hidden.contiguous())
        return self.local.logits_of(hidden)

    def run_decode(self, items: list[ScheduledRequest], input_ids: torch.Tensor) -> torch.Tensor:
        step = decode_step_inputs(items, self.page_size)
        self.workers.send(RunDecode(step))
        self.workers.group.broadcast_tensor(input_ids.contiguous())
        return self.local.run_decode_step(step, input_ids)

    def close(self) -> None:
        self.workers.close()
