"""The `ipc` transport (same host). On CPU the decode rank's L1 pool lives in a shared-
memory file that the prefill rank maps after checking it (ipc_pool.py); on CUDA the pool
is shared by a CUDA IPC handle.
A write copies whole pages across every layer: on CUDA one Triton kernel on the prefill
GPU stores straight into the decode pool (same GPU, or a peer over NVLink), else a torch
gather, copy and scatter (`use_kernel=False`, the parity reference)."""

from __future__ import annotations

import base64
import logging
import os
import weakref
from pathlib import Path
from typing import Any

import torch

from kvstrata.disagg.transport.base import (
    WRITTEN,
    KVReceiver,
    KVSender,
    PendingWrite,
    TransferError,
)
from kvstrata.disagg.transport.endpoints import CudaIpcEndpoint, Endpoint, ShmEndpoint
from kvstrata.disagg.transport.ipc_pool import (
    DTYPES,
    REFUSED,
    SHM_DIR,
    PoolHeader,
    open_pool,
    process_exists,
    read_own_header,
    remove_stale_pools,
    shared_pool_data,
)
from kvstrata.kvcache.pages import KVPool

logger = logging.getLogger(__name__)
# CUDA pools of receivers in this process, by endpoint id: a sender in the same process
# (prefill and decode engines side by side) uses the tensor itself. Weak: no pool is kept
# alive by being listed here.
_SAME_PROCESS_POOLS: weakref.WeakValueDictionary[str, torch.Tensor] = weakref.WeakValueDictionary()
_DTYPES = {str(d): d for d in DTYPES}
__all__ = ["SHM_DIR", "IpcReceiver", "IpcSender", "remove_stale_pools", "shared_pool_data"]


class IpcReceiver(KVReceiver):
    def __init__(self, pool: KVPool, shm_path: Path | None) -> None:
        self.pool = pool
        self.shm_path = shm_path
        data = pool.data
        self._endpoint: Endpoint
        if data.is_cuda:
            pool_id = f"cuda-{os.getpid()}-{data.data_ptr()}"
            self._endpoint = CudaIpcEndpoint(
                backend="ipc",
                id=pool_id,
                shape=list(data.shape),
                dtype=str(data.dtype),
                kv_scales=pool.scales.fingerprint,
                cuda_ipc=encode_cuda_ipc(data),
                pid=os.getpid(),
            )
            _SAME_PROCESS_POOLS[pool_id] = data
        else:
            if shm_path is None:
                raise ValueError("a CPU ipc receiver needs its pool in shared memory")
            header = read_own_header(shm_path)
            self._endpoint = ShmEndpoint(
                backend="ipc",
                id=str(shm_path),
                shape=list(data.shape),
                dtype=str(data.dtype),
                kv_scales=pool.scales.fingerprint,
                shm_path=str(shm_path),
                owner=header.owner,
                generation=header.generation,
            )

    def endpoint(self) -> Endpoint:
        return self._endpoint

    def close(self) -> None:
        if self.shm_path is not None:
            self.shm_path.unlink(missing_ok=True)


def check_shm_endpoint(endpoint: ShmEndpoint) -> None:
    """Open and check the pool a (schema-checked) CPU ipc endpoint names, then drop it;
    raises TransferError(REFUSED) for anything but a live pool of this user's decode rank."""
    dtype = _DTYPES[endpoint["dtype"]]
    expected = PoolHeader(
        endpoint["owner"], endpoint["generation"], tuple(endpoint["shape"]), dtype
    )
    open_pool(endpoint["shm_path"], expected)  # the mapping goes with the unused tensor


class _QueuedCopy:
    """A `PendingWrite`: the copy kernel is queued on the prefill GPU."""

    def __init__(self, done: torch.cuda.Event) -> None:
        self.done = done

    def poll(self) -> bool:
        return self.done.query()


def _endpoint_gone(endpoint: Endpoint) -> bool:
    """Its decode rank has ended: its shared-memory file was removed, or its process left."""
    if "shm_path" in endpoint:
        return not Path(endpoint["shm_path"]).exists()
    if "pid" in endpoint:
        pid = endpoint["pid"]
        return isinstance(pid, int) and not process_exists(pid)
    return False


class IpcSender(KVSender):
    """Maps each decode pool it writes to once; a mapping goes when a new pool is mapped
    and its own decode rank has ended (so ranks that come and go leak no mappings)."""

    def __init__(self, pool: KVPool, use_kernel: bool = True) -> None:
        super().__init__(pool)
        self.use_kernel = use_kernel and pool.data.is_cuda
        self._remotes: dict[str, tuple[Endpoint, torch.Tensor]] = {}  # id -> mapped
        self._direct_only: set[str] = set()  # endpoints the kernel cannot reach

    @property
    def num_mapped_pools(self) -> int:
        return len(self._remotes)

    def write(self, endpoint: Endpoint, src_page_ids: list[int], dst_page_ids: list[int]) -> None:
        done = self._launch(endpoint, src_page_ids, dst_page_ids)
        if done is not None:
            done.synchronize()

    def start(
        self, endpoint: Endpoint, src_page_ids: list[int], dst_page_ids: list[int]
    ) -> PendingWrite:
        """The CUDA kernel path returns once the copy is queued (polled through an event
        on the prefill stream, so the engine thread never waits for it); the others copy
        before returning (nothing here waits on the receiving process)."""
        done = self._launch(endpoint, src_page_ids, dst_page_ids)
        return WRITTEN if done is None else _QueuedCopy(done)

    def _launch(
        self, endpoint: Endpoint, src_page_ids: list[int], dst_page_ids: list[int]
    ) -> torch.cuda.Event | None:
        """Queue the copy on the prefill GPU (an event fires once it is in place) or make
        it before returning (None). Any failure is this room's TransferError alone."""
        try:
            return self._copy(endpoint, src_page_ids, dst_page_ids)
        except TransferError:
            raise
        except Exception as e:  # whatever the endpoint made torch raise: this room's alone
            logger.warning("ipc write refused: %s: %s", type(e).__name__, e)
            raise TransferError(f"the ipc write failed ({type(e).__name__})") from None

    def _copy(
        self, endpoint: Endpoint, src_page_ids: list[int], dst_page_ids: list[int]
    ) -> torch.cuda.Event | None:
        if len(src_page_ids) != len(dst_page_ids):
            raise TransferError(f"{len(src_page_ids)} source pages for {len(dst_page_ids)} slots")
        if not src_page_ids:
            return None
        remote = self._remote(endpoint)
        if max(dst_page_ids) >= remote.shape[2] or min(dst_page_ids) < 0:
            raise TransferError("destination pages outside the decode pool")
        local = self.pool.data
        if self.use_kernel and endpoint["id"] not in self._direct_only:
            from kvstrata.disagg.transport.ipc_kernel import write_pages

            # On the prefill compute stream: ordered after the steps that computed the
            # pages. Once the kernel is done its stores are in the remote pool.
            try:
                with torch.cuda.device(local.device):
                    write_pages(local, remote, src_page_ids, dst_page_ids)
                    done = torch.cuda.Event()
                    done.record()
                    return done
            except ValueError as e:  # Triton refused the remote pointer before launching
                logger.warning(
                    "ipc kernel cannot reach %s (%s); copying with torch", remote.device, e
                )
                self._direct_only.add(endpoint["id"])
        src = torch.tensor(src_page_ids, device=local.device)
        dst = torch.tensor(dst_page_ids, device=remote.device)
        remote[:, :, dst] = local[:, :, src].to(remote.device)
        if remote.is_cuda:
            torch.cuda.synchronize(remote.device)
        return None

    def _remote(self, endpoint: Endpoint) -> torch.Tensor:
        key = endpoint.get("id")
        if key in self._remotes:
            return self._remotes[key][1]
        if endpoint.get("backend") != "ipc" or key is None:
            raise TransferError(f"not an ipc endpoint: {sorted(endpoint)}")
        for gone in [k for k, (known, _) in self._remotes.items() if _endpoint_gone(known)]:
            del self._remotes[gone]
            self._direct_only.discard(gone)
        shape, dtype_name = endpoint["shape"], endpoint["dtype"]
        local = self.pool.data
        if (
            dtype_name != str(local.dtype)
            or len(shape) != local.dim()
            or shape[:2] + shape[3:] != list(local.shape[:2] + local.shape[3:])
        ):
            raise TransferError(REFUSED)  # the caller learns nothing of this pool's shape
        if "cuda_ipc" in endpoint and endpoint.get("pid") == os.getpid():
            remote = _SAME_PROCESS_POOLS[key]  # CUDA cannot open its own process's handles
        elif "cuda_ipc" in endpoint:
            _check_same_user(endpoint.get("pid"))
            remote = decode_cuda_ipc(endpoint["cuda_ipc"], _DTYPES[dtype_name])
        elif "shm_path" in endpoint:
            expected = PoolHeader(
                endpoint["owner"], endpoint["generation"], tuple(shape), _DTYPES[dtype_name]
            )
            remote = open_pool(endpoint["shm_path"], expected)
        else:  # `backend: ipc` with neither a pool file nor a CUDA handle
            raise TransferError(f"not an ipc endpoint: {sorted(endpoint)}")
        if self.use_kernel and remote.device != self.pool.data.device:
            from kvstrata.disagg.transport.ipc_kernel import enable_peer_access

            if not enable_peer_access(self.pool.data.device, remote.device):
                self._direct_only.add(key)
        self._remotes[key] = (endpoint, remote)
        return remote

    def close(self) -> None:
        self._remotes.clear()


def _check_same_user(pid: Any) -> None:
    """A CUDA pool is opened only from a live process of this user (a decode rank of this
    host's cluster runs as the same user as its prefill ranks)."""
    try:
        if not isinstance(pid, int) or os.stat(f"/proc/{pid}").st_uid != os.geteuid():
            raise TransferError(REFUSED)
    except OSError:
        raise TransferError(REFUSED) from None


# CUDA IPC descriptions travel as JSON (never pickle: a peer must not run code here). The
# fields are those of torch's own reduction of a CUDA tensor for multiprocessing.
_BYTES_FIELDS = ("handle", "ref_counter_handle", "event_handle")


def encode_cuda_ipc(tensor: torch.Tensor) -> dict[str, Any]:
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(tensor)
    (
        _,
        size,
        stride,
        offset,
        _,
        _,
        device,
        handle,
        storage_bytes,
        storage_offset_bytes,
        _,
        ref_handle,
        ref_offset,
        event_handle,
        event_sync,
    ) = args
    fields: dict[str, Any] = {
        "size": list(size),
        "stride": list(stride),
        "offset": offset,
        "device": device,
        "handle": handle,
        "storage_bytes": storage_bytes,
        "storage_offset_bytes": storage_offset_bytes,
        "ref_counter_handle": ref_handle,
        "ref_counter_offset": ref_offset,
        "event_handle": event_handle,
        "event_sync_required": event_sync,
    }
    for name in _BYTES_FIELDS:
        fields[name] = base64.b64encode(fields[name] or b"").decode()
    return fields


def decode_cuda_ipc(fields: dict[str, Any], dtype: torch.dtype) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    raw = {name: base64.b64decode(fields[name]) for name in _BYTES_FIELDS}
    return rebuild_cuda_tensor(
        torch.Tensor,
        torch.Size(fields["size"]),
        tuple(fields["stride"]),
        int(fields["offset"]),
        torch.storage.TypedStorage,
        dtype,
        int(fields["device"]),
        raw["handle"],
        int(fields["storage_bytes"]),
        int(fields["storage_offset_bytes"]),
        False,
        raw["ref_counter_handle"],
        int(fields["ref_counter_offset"]),
        raw["event_handle"] or None,
        bool(fields["event_sync_required"]),
    )
