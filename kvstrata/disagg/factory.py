"""Builds a rank's PD pieces from its config: where its L1 pool lives (shared memory when
an `ipc` decode rank must expose it), its transport end, and its handoff."""

from __future__ import annotations

from pathlib import Path

import torch

from kvstrata.config import EngineConfig
from kvstrata.disagg.decode import DecodeHandoff
from kvstrata.disagg.handoff import Handoff, SchedulerEntry
from kvstrata.disagg.local_prefill import make_local_prefill_policy
from kvstrata.disagg.prefill import PrefillHandoff
from kvstrata.disagg.restore import make_l3_restores
from kvstrata.disagg.transport.base import KVReceiver, KVSender
from kvstrata.disagg.transport.ipc import IpcReceiver, IpcSender, shared_pool_data
from kvstrata.engine.kv_manager import RequestKV
from kvstrata.engine.scheduler import Scheduler
from kvstrata.kvcache.pages import KVPool


def pool_storage(
    config: EngineConfig, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor | None, Path | None]:
    """Storage for the L1 pool: a shared-memory file for an `ipc` decode rank on CPU (the
    prefill rank maps it), else None (a private allocation)."""
    exposed = (
        config.disaggregation_mode == "decode"
        and config.disaggregation_transfer_backend == "ipc"
        and device.type == "cpu"
    )
    return shared_pool_data(shape, dtype) if exposed else (None, None)


def make_receiver(config: EngineConfig, pool: KVPool, shm_path: Path | None) -> KVReceiver:
    if config.disaggregation_transfer_backend == "mooncake":
        from kvstrata.disagg.transport.mooncake import MooncakeReceiver

        return MooncakeReceiver(pool, config.disaggregation_mooncake_config)
    return IpcReceiver(pool, shm_path)


def make_sender(config: EngineConfig, pool: KVPool) -> KVSender:
    if config.disaggregation_transfer_backend == "mooncake":
        from kvstrata.disagg.transport.mooncake import MooncakeSender

        return MooncakeSender(pool, config.disaggregation_mooncake_config)
    return IpcSender(pool, use_kernel=config.disaggregation_ipc_io_backend != "direct")


def make_handoff(
    config: EngineConfig, kv: RequestKV, scheduler: Scheduler, pool: KVPool,
    shm_path: Path | None, num_params: int, max_model_len: int,
) -> Handoff:  # fmt: skip
    """`num_params` (the model's) and `max_model_len` size a decode rank's local prefill
    cost model."""
    if config.disaggregation_mode == "prefill":
        mooncake_on_cuda = (
            config.disaggregation_transfer_backend == "mooncake" and pool.data.is_cuda
        )
        stream = config.stream_writes == "on" or (
            config.stream_writes == "auto" and not mooncake_on_cuda
        )
        return PrefillHandoff(scheduler, make_sender(config, pool), config.page_size, stream)
    if config.disaggregation_mode == "decode":
        policy = make_local_prefill_policy(
            config, pool.data.device.type, num_params, pool.page_bytes // config.page_size,
            max_model_len,
        )  # fmt: skip
        restores = make_l3_restores(
            kv, config.disaggregation_decode_parallel_restore,
            has_l3=config.hicache_storage_backend != "none",
        )  # fmt: skip
        return DecodeHandoff(
            kv, scheduler, make_receiver(config, pool, shm_path), pool.page_bytes,
            config.disaggregation_decode_prealloc_timeout_s, policy, restores,
        )  # fmt: skip
    return SchedulerEntry(scheduler)
