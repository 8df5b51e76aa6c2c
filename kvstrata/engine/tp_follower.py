"""A tensor-parallel follower: one worker process of a rank whose leader runs the engine.
It holds its shard of the model and its head slice of every L1 (and L2) page, and runs
each step and page copy the leader broadcasts (same inputs, same order), joining the
model's collectives."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvstrata.attention import make_attention_backend
from kvstrata.config import EngineConfig
from kvstrata.engine.kv_calibration import Calibrate, calibrate
from kvstrata.engine.memory import bind_device, resolve_dtype
from kvstrata.engine.runner import StepInputs, build_runner
from kvstrata.engine.tp_transfer import FollowerWrites, SendPages, publish_endpoint
from kvstrata.kvcache.copier import Copier
from kvstrata.kvcache.factory import make_copier, make_l3
from kvstrata.kvcache.host_pool import HostPool
from kvstrata.kvcache.kv_scales import KVScales
from kvstrata.kvcache.l3_io import L3IO, L3Job
from kvstrata.kvcache.pages import KVPool
from kvstrata.model.config import ModelConfig
from kvstrata.model.loader import load_model
from kvstrata.model.tp import TPGroup
from kvstrata.model.tp_shard import Shard

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from kvstrata.engine.role import RoleFactory

TP_HOST = "127.0.0.1"  # a rank's workers share one host
INIT_TIMEOUT_S = 600.0  # a collective waits this long for a worker: loads can take minutes
LEADER_POLL_S = 1.0


@dataclass(frozen=True)
class WorkerInit:
    """What the leader decides after loading and tells every follower before serving."""

    num_pages: int
    kv_dtype: torch.dtype
    scales: KVScales
    max_model_len: int
    host_pages: int  # L2 pages per worker (0: no L2)
    l3_namespace: bytes | None  # the rank's L3 namespace (None: no L3)


# The leader's commands, in the order it runs them itself.
@dataclass(frozen=True)
class RunStep:
    step: StepInputs


@dataclass(frozen=True)
class RunDecode:  # input ids follow as a tensor broadcast
    step: StepInputs


@dataclass(frozen=True)
class Logits:  # hidden states follow as a tensor broadcast
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class CopyPages:
    """A copier call the leader's cache made (`backup`, `load_back`, `fence_loads`,
    `fence_l1`): each worker makes it on its own head slice of the pages."""

    method: str
    src_page_ids: list[int]
    dst_page_ids: list[int]


@dataclass(frozen=True)
class L3Read:
    """Start reading this worker's slices of `page_hashes` into `host_page_ids`."""

    job_id: int
    page_hashes: list[bytes]
    host_page_ids: list[int]


@dataclass(frozen=True)
class L3ReadDone:
    """Wait for read `job_id`, then agree on how many leading pages every worker has."""

    job_id: int


@dataclass(frozen=True)
class L3Write:
    page_hashes: list[bytes]
    host_page_ids: list[int]


@dataclass(frozen=True)
class L3Clear:
    pass


@dataclass(frozen=True)
class Stop:
    pass


Command = (
    RunStep
    | RunDecode
    | Logits
    | CopyPages
    | L3Read
    | L3ReadDone
    | L3Write
    | L3Clear
    | SendPages
    | Stop
)
COPIER_CALLS = ("backup", "load_back", "fence_loads", "fence_l1")


class FollowerL3:
    """A follower's L3: its slice of every page the leader reads or writes, on its own
    L3 threads; reads are joined, by job id, when the leader collects them."""

    def __init__(self, io: L3IO, copier: Copier) -> None:
        self.io, self.copier = io, copier
        self.reads: dict[int, L3Job] = {}
        self.writes: list[L3Job] = []

    def run(self, command: L3Read | L3ReadDone | L3Write | L3Clear, group: TPGroup) -> None:
        if isinstance(command, L3Read):
            self.reads[command.job_id] = self.io.read(command.page_hashes, command.host_page_ids)
        elif isinstance(command, L3ReadDone):
            group.min_over_group(self.reads.pop(command.job_id).future.result())
        elif isinstance(command, L3Write):
            ready = self.copier.host_fence()  # after this worker's backup of those pages
            self.writes = [job for job in self.writes if not job.future.done()]
            self.writes.append(self.io.write(command.page_hashes, command.host_page_ids, ready))
        else:
            self.io.clear()

    def close(self) -> None:
        self.io.shutdown()
        self.io.backend.close()


def _exit_with_leader(leader_pid: int) -> None:
    """Leave as soon as the leader process is gone, even by SIGKILL: a follower blocked in
    a collective would otherwise wait out its timeout, holding its device."""

    def watch() -> None:
        while os.getppid() == leader_pid:
            time.sleep(LEADER_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="kvstrata-tp-leader-watch", daemon=True).start()


def worker_device(leader: torch.device, rank: int) -> torch.device:
    """Worker `rank`'s device: the leader's CUDA index + rank, or the CPU."""
    if leader.type != "cuda":
        return leader
    return torch.device("cuda", (leader.index or 0) + rank)


def follower_main(
    config: EngineConfig,
    leader: torch.device,
    rank: int,
    port: int,
    roles: RoleFactory,
    reports: Connection,
) -> None:
    """The follower process: build, then serve the leader's commands until Stop (or until
    a collective fails: the leader is gone, and so is this worker). `roles` builds its end
    of the rank's PD transport; `reports` takes its PD writes' outcomes to the leader."""
    _exit_with_leader(os.getppid())
    device = worker_device(leader, rank)
    bind_device(device)
    size = config.model.tp_size
    group = TPGroup((TP_HOST, port), rank, size, device, INIT_TIMEOUT_S)
    l3: FollowerL3 | None = None
    writes: FollowerWrites | None = None
    try:
        mc = ModelConfig.from_dir(config.model.path)
        shard = Shard(rank, size)
        model = load_model(
            config.model.path, resolve_dtype(config.model.dtype, device, mc), device, shard
        )
        model.set_tp(group, rank * shard.vocab_rows(mc.vocab_size), mc.vocab_size)
        init: WorkerInit | Calibrate | Stop = group.broadcast_object()
        while isinstance(init, Calibrate):
            calibrate(model, init.token_ids, init.kv_dtype, init.segment_tokens)
            init = group.broadcast_object()
        if isinstance(init, Stop):  # the leader failed to start
            return
        local = shard.local_config(mc)
        page_size = config.pool.page_size
        shape = (local.num_layers, 2, init.num_pages, page_size, local.num_kv_heads, local.head_dim)
        pool_data, shm_path = roles.pool_storage(config, shape, init.kv_dtype, device)
        pool = KVPool(
            init.num_pages,
            page_size,
            local.num_layers,
            local.num_kv_heads,
            local.head_dim,
            init.kv_dtype,
            device,
            pool_data,
            init.scales,
        )
        transfer = roles.worker_transfer(config, pool, shm_path)
        publish_endpoint(group, transfer)
        if transfer is not None:
            writes = FollowerWrites(rank, transfer, reports)
        copier = None
        if init.host_pages:
            host_pool = HostPool(
                init.host_pages,
                config.pool.page_size,
                local.num_layers,
                local.num_kv_heads,
                local.head_dim,
                init.kv_dtype,
                device.type == "cuda",
            )
            copier = make_copier(config.l2.io_backend, pool, host_pool)
            if init.l3_namespace is not None:
                l3 = FollowerL3(make_l3(config, host_pool, init.l3_namespace, rank), copier)
        speed = config.speed
        backend = make_attention_backend(speed.attention_backend, pool, device, speed.disable_pdl)
        runner = build_runner(config, model, backend, device, init.max_model_len)
        group.broadcast_object()  # ready: the leader serves from here on
        with torch.inference_mode():
            while not isinstance(command := group.broadcast_object(), Stop):
                if isinstance(command, RunStep):
                    runner.run_step(command.step)
                elif isinstance(command, CopyPages):
                    assert copier is not None and command.method in COPIER_CALLS
                    call = getattr(copier, command.method)
                    pages = (command.src_page_ids, command.dst_page_ids)
                    call(*pages) if command.method in ("backup", "load_back") else call()
                elif isinstance(command, (L3Read, L3ReadDone, L3Write, L3Clear)):
                    assert l3 is not None
                    l3.run(command, group)
                elif isinstance(command, SendPages):
                    assert writes is not None
                    writes.start(command)
                elif isinstance(command, RunDecode):
                    ids = torch.empty(len(command.step.input_ids), dtype=torch.long, device=device)
                    runner.run_decode_step(command.step, group.broadcast_tensor(ids))
                else:
                    hidden = torch.empty(command.shape, dtype=command.dtype, device=device)
                    runner.logits_of(group.broadcast_tensor(hidden))
    finally:
        if writes is not None:
            writes.close()
        if l3 is not None:
            l3.close()
        group.close()
