"""The typed endpoint a decode rank's receiver describes its pool with, as the JSON object
it travels as in a `PrefillTask`: shared memory or CUDA IPC (`ipc`), or a Transfer Engine
session (`mooncake`). `disagg/wire.py` checks one that arrives (test_endpoints.py: same)."""

from __future__ import annotations

from typing import Any, Literal, NotRequired, TypedDict, final


class _PoolFields(TypedDict):
    id: str  # unique per receiver (senders cache their connection by it)
    shape: list[int]  # [layers, 2, pages, page_size, kv_heads, head_dim]
    dtype: str  # str(torch.dtype)
    kv_scales: NotRequired[str]  # KVScales.fingerprint: "" or absent for unit scales
    # A tensor-parallel decode rank's: its worker count, and workers 1.. pools' endpoints
    # (this one is worker 0's); absent: 1 and none.
    tp_size: NotRequired[int]
    tp_slices: NotRequired[list[Any]]


@final  # so that `"key" in endpoint` narrows the union for the type checker
class ShmEndpoint(_PoolFields):
    """A CPU decode pool in a shared-memory file, and what its file header must say."""

    backend: Literal["ipc"]
    shm_path: str
    owner: str  # 32 hex digits, written into the file's header at creation
    generation: int


@final
class CudaIpcEndpoint(_PoolFields):
    """A GPU decode pool, as torch's CUDA IPC reduction of its tensor."""

    backend: Literal["ipc"]
    cuda_ipc: dict[str, Any]  # ipc.encode_cuda_ipc
    pid: int  # the decode rank's process (a pool whose process left is gone)


class StagingEndpoint(TypedDict):
    """The decode rank's staging region and control server (mooncake_staging.StagingInfo)."""

    host: str
    port: int
    base_ptr: int
    slot_bytes: int
    secret: str  # 64 hex digits; never logged
    every_write: bool


@final
class MooncakeEndpoint(_PoolFields):
    """A decode pool registered with a Transfer Engine, reached through its session."""

    backend: Literal["mooncake"]
    session: str
    base_ptr: int
    staging: NotRequired[StagingEndpoint | None]  # absent or None: no coalesced writes


Endpoint = ShmEndpoint | CudaIpcEndpoint | MooncakeEndpoint
