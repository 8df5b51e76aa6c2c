"""Builds a rank's role from its config (`PD_ROLES`, the engine's role factory for every
mode): where its L1 pool lives (shared memory when an `ipc` decode rank must expose it),
its transport end, and the role itself (unified, PrefillHandoff or DecodeHandoff); on a
tensor-parallel rank, each follower's transport end too."""

from __future__ import annotations

from pathlib import Path

import torch

from kvstrata.config import EngineConfig
from kvstrata.config.mooncake import MooncakeTransportConfig
from kvstrata.config.pd import PDOptions
from kvstrata.disagg.decode import DecodeHandoff
from kvstrata.disagg.local_prefill import make_local_prefill_policy
from kvstrata.disagg.prefill import PrefillHandoff
from kvstrata.disagg.restore import make_l3_restores
from kvstrata.disagg.tp_transfer import TPReceiver, TPSender, WorkerEnd
from kvstrata.disagg.transport.base import KVReceiver, KVSender
from kvstrata.disagg.transport.ipc import IpcReceiver, IpcSender, shared_pool_data
from kvstrata.engine.role import EngineServices, Role, RoleParts, SchedulerEntry
from kvstrata.kvcache.pages import KVPool


def pool_storage(
    config: EngineConfig, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor | None, Path | None]:
    """Storage for the L1 pool: a shared-memory file for an `ipc` decode rank on CPU (the
    prefill rank maps it), else None (a private allocation)."""
    exposed = config.pd.is_decode and config.pd.transfer_backend == "ipc" and device.type == "cpu"
    return shared_pool_data(shape, dtype) if exposed else (None, None)


def make_receiver(config: PDOptions, pool: KVPool, shm_path: Path | None) -> KVReceiver:
    if config.transfer_backend == "mooncake":
        from kvstrata.disagg.transport.mooncake import MooncakeReceiver

        return MooncakeReceiver(pool, config.mooncake_config)
    return IpcReceiver(pool, shm_path)


def make_sender(config: PDOptions, pool: KVPool) -> KVSender:
    if config.transfer_backend == "mooncake":
        from kvstrata.disagg.transport.mooncake import MooncakeSender

        return MooncakeSender(pool, config.mooncake_config)
    return IpcSender(pool, use_kernel=config.ipc_io_backend != "direct")


def streams_writes(config: EngineConfig, pool_on_cuda: bool) -> bool:
    """`--stream-writes` of a prefill rank, `auto` resolved: on, but where the mooncake
    transport's io threads copy GPU memory themselves (no host staging), which streamed
    writes measured slower than one write at the end (docs/results.md)."""
    pd = config.pd
    if pd.stream_writes != "auto":
        return pd.stream_writes == "on"
    if pd.transfer_backend != "mooncake" or not pool_on_cuda:
        return True
    mooncake = MooncakeTransportConfig.from_json(pd.mooncake_config)
    return mooncake.host_staging_for(True)


class PdRoles:
    """The role factory for every `--disaggregation-mode`: `null` (unified: straight to
    the scheduler), `prefill` (PrefillHandoff) and `decode` (DecodeHandoff)."""

    def pool_storage(
        self,
        config: EngineConfig,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
    ) -> tuple[torch.Tensor | None, Path | None]:
        return pool_storage(config, shape, dtype, device)

    def make_role(self, parts: RoleParts, services: EngineServices) -> Role:
        config, pool = parts.config, parts.pool
        pd, page_size = config.pd, config.pool.page_size
        if pd.mode == "prefill":
            stream = streams_writes(config, pool.data.is_cuda)
            sender = make_sender(pd, pool)
            if parts.tp is not None:
                sender = TPSender(sender, parts.tp)
            return PrefillHandoff(parts.scheduler, sender, page_size, services, stream)
        if pd.mode == "decode":
            policy = make_local_prefill_policy(
                config,
                pool.data.device.type,
                parts.num_params,
                pool.page_bytes // page_size,
                parts.max_model_len,
            )
            has_l3 = config.l3.backend != "none"
            restores = make_l3_restores(parts.kv, pd.parallel_restore, has_l3=has_l3)
            receiver = make_receiver(pd, pool, parts.shm_path)
            if parts.tp is not None:
                receiver = TPReceiver(receiver, parts.tp)
            return DecodeHandoff(
                parts.kv,
                parts.scheduler,
                receiver,
                pool.page_bytes,
                services,
                parts.vocab_size,
                pd.prealloc_timeout_s,
                policy,
                restores,
            )
        return SchedulerEntry(parts.scheduler)

    def worker_transfer(
        self, config: EngineConfig, pool: KVPool, shm_path: Path | None
    ) -> WorkerEnd | None:
        pd = config.pd
        if pd.mode == "prefill":
            return WorkerEnd(None, make_sender(pd, pool))
        if pd.mode == "decode":
            return WorkerEnd(make_receiver(pd, pool, shm_path), None)
        return None


PD_ROLES = PdRoles()
