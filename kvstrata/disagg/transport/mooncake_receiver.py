"""The decode side of the `mooncake` transport: `MooncakeReceiver` registers the L1 pool
and, for coalesced writes, a staging region served by a `StagingServer`."""

from __future__ import annotations

import json
import secrets
import uuid

import torch

from kvstrata.config.mooncake import MooncakeTransportConfig
from kvstrata.disagg.transport.base import KVReceiver, TransferError
from kvstrata.disagg.transport.endpoints import Endpoint, MooncakeEndpoint
from kvstrata.disagg.transport.mooncake_control import SECRET_BYTES
from kvstrata.disagg.transport.mooncake_engine import register, start_engine
from kvstrata.disagg.transport.mooncake_staging import (
    StagingInfo,
    StagingLimits,
    StagingServer,
)
from kvstrata.kvcache.pages import KVPool


class MooncakeReceiver(KVReceiver):
    """Decode side: keeps `pool.data` registered until `close`. Peers may write any page at
    any time while it is registered, directly or through the staging server's scatter
    (which only senders holding the endpoint's secret may use); which pages they may write
    is the decode scheduler's business (a room's pages stay allocated until prefill can no
    longer write them). The endpoint carries that secret: callers must not log it."""

    def __init__(self, pool: KVPool, config_json: str) -> None:
        self.config = MooncakeTransportConfig.from_json(config_json)
        self.pool = pool
        self._engine, session = start_engine(self.config)
        self._base_ptr = register(self._engine, pool.data)
        self._staging: StagingServer | None = None
        self._endpoint = MooncakeEndpoint(
            backend="mooncake",
            id=f"mooncake-{session}-{uuid.uuid4().hex[:12]}",
            session=session,
            base_ptr=self._base_ptr,
            shape=list(pool.data.shape),
            dtype=str(pool.data.dtype),
            kv_scales=pool.scales.fingerprint,
        )
        if self.config.coalesce:  # registered before any peer can see the endpoint
            config = self.config
            every_write = config.host_staging_for(pool.data.is_cuda)
            on_host = every_write and pool.data.is_cuda
            self._staging_data = torch.zeros(
                config.staging_slots,
                config.staging_slot_bytes,
                dtype=torch.uint8,
                device="cpu" if on_host else pool.data.device,
                pin_memory=on_host,
            )
            if self._staging_data.is_cuda:  # zeroed before the staging stream touches it
                torch.cuda.synchronize(self._staging_data.device)
            staging_ptr = register(self._engine, self._staging_data, "the staging region")
            # Only senders that received this rank's endpoint (inside a PrefillTask, over the
            # cluster-keyed rank-to-rank call) hold the secret the control server asks for.
            secret = secrets.token_bytes(SECRET_BYTES)
            limits = StagingLimits(quarantine_s=2 * config.timeout_s, message_s=config.timeout_s)
            self._staging = StagingServer(
                pool.data, self._staging_data, config.local_hostname, secret, limits
            )
            info = StagingInfo(
                config.local_hostname,
                self._staging.port,
                staging_ptr,
                config.staging_slot_bytes,
                secret.hex(),
                every_write=every_write,
            )
            self._endpoint["staging"] = info.to_json()

    def endpoint(self) -> Endpoint:
        if self._engine is None:
            raise TransferError("the mooncake receiver is closed")
        return json.loads(json.dumps(self._endpoint))  # a copy the caller may change

    def close(self) -> None:
        """Stops the staging server, unregisters the pool and the staging region (later
        writes are refused by this side) and stops the engine."""
        engine, self._engine = self._engine, None
        if engine is not None:
            if self._staging is not None:
                self._staging.close()
                engine.unregister_memory(self._staging_data.data_ptr())
            engine.unregister_memory(self._base_ptr)
