"""The `ipc` transport (same host). On CPU the decode rank's L1 pool lives in a shared-
memory file that the prefill rank maps; on CUDA the pool is shared by a CUDA IPC handle.
A write copies whole pages across every layer: on CUDA one Triton kernel on the prefill
GPU stores straight into the decode pool (same GPU, or a peer over NVLink), else a torch
gather, copy and scatter (`use_kernel=False`, the parity reference)."""

from __future__ import annotations

import base64
import logging
import os
import uuid
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
    check_shapes,
)
from kvstrata.kvcache.pages import KVPool

logger = logging.getLogger(__name__)
SHM_DIR = Path("/dev/shm")
_POOL_PREFIX = "kvstrata-kv-"  # then "<pid>-<random>"
# CUDA pools of receivers in this process, by endpoint id: a sender in the same process
# (prefill and decode engines side by side) uses the tensor itself. Weak: no pool is kept
# alive by being listed here.
_SAME_PROCESS_POOLS: weakref.WeakValueDictionary[str, torch.Tensor] = weakref.WeakValueDictionary()
_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16)}


def shared_pool_data(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, Path]:
    """A zeroed CPU tensor backed by a new file in /dev/shm. The file is unlinked when
    the tensor is collected or the process exits (mappings made by peers stay valid);
    pools left by processes that died without that (SIGKILL) are removed first."""
    remove_stale_pools()
    path = SHM_DIR / f"{_POOL_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
    numel = 1
    for dim in shape:
        numel *= dim
    data = torch.from_file(str(path), shared=True, size=numel, dtype=dtype).view(shape)
    weakref.finalize(data, _unlink_quietly, path)
    return data, path


def _unlink_quietly(path: Path) -> None:
    path.unlink(missing_ok=True)


def remove_stale_pools() -> list[Path]:
    """Unlink the pool files of processes that no longer exist; returns them. A peer that
    still maps one keeps its mapping (unlinking only drops the name)."""
    removed = []
    for path in SHM_DIR.glob(f"{_POOL_PREFIX}*"):
        pid_text = path.name[len(_POOL_PREFIX) :].split("-", 1)[0]
        if pid_text.isdigit() and not _process_exists(int(pid_text)):
            _unlink_quietly(path)
            removed.append(path)
    return removed


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


class IpcReceiver(KVReceiver):
    def __init__(self, pool: KVPool, shm_path: Path | None) -> None:
        self.pool = pool
        self.shm_path = shm_path
        data = pool.data
        self._endpoint: dict[str, Any] = {
            "backend": "ipc",
            "shape": list(data.shape),
            "dtype": str(data.dtype),
        }
        if data.is_cuda:
            self._endpoint["cuda_ipc"] = encode_cuda_ipc(data)
            self._endpoint["id"] = f"cuda-{os.getpid()}-{data.data_ptr()}"
            self._endpoint["pid"] = os.getpid()
            _SAME_PROCESS_POOLS[self._endpoint["id"]] = data
        else:
            if shm_path is None:
                raise ValueError("a CPU ipc receiver needs its pool in shared memory")
            self._endpoint["shm_path"] = str(shm_path)
            self._endpoint["id"] = str(shm_path)

    def endpoint(self) -> dict[str, Any]:
        return self._endpoint

    def close(self) -> None:
        if self.shm_path is not None:
            self.shm_path.unlink(missing_ok=True)


class _QueuedCopy:
    """A `PendingWrite`: the copy kernel is queued on the prefill GPU."""

    def __init__(self, done: torch.cuda.Event) -> None:
        self.done = done

    def poll(self) -> bool:
        return self.done.query()


def _endpoint_gone(endpoint: dict[str, Any]) -> bool:
    """Its decode rank has ended: its shared-memory file was removed, or its process left."""
    if "shm_path" in endpoint:
        return not Path(endpoint["shm_path"]).exists()
    return isinstance(endpoint.get("pid"), int) and not _process_exists(endpoint["pid"])


class IpcSender(KVSender):
    """Maps each decode pool it writes to once; a mapping goes when a new pool is mapped
    and its own decode rank has ended (so ranks that come and go leak no mappings)."""

    def __init__(self, pool: KVPool, use_kernel: bool = True) -> None:
        super().__init__(pool)
        self.use_kernel = use_kernel and pool.data.is_cuda
        self._remotes: dict[str, tuple[dict[str, Any], torch.Tensor]] = {}  # id -> mapped
        self._direct_only: set[str] = set()  # endpoints the kernel cannot reach

    @property
    def num_mapped_pools(self) -> int:
        return len(self._remotes)

    def write(
        self, endpoint: dict[str, Any], src_page_ids: list[int], dst_page_ids: list[int]
    ) -> None:
        done = self._launch(endpoint, src_page_ids, dst_page_ids)
        if done is not None:
            done.synchronize()

    def start(
        self, endpoint: dict[str, Any], src_page_ids: list[int], dst_page_ids: list[int]
    ) -> PendingWrite:
        """The CUDA kernel path returns once the copy is queued (polled through an event
        on the prefill stream, so the engine thread never waits for it); the others copy
        before returning (nothing here waits on the receiving process)."""
        done = self._launch(endpoint, src_page_ids, dst_page_ids)
        return WRITTEN if done is None else _QueuedCopy(done)

    def _launch(
        self, endpoint: dict[str, Any], src_page_ids: list[int], dst_page_ids: list[int]
    ) -> torch.cuda.Event | None:
        """Queue the copy on the prefill GPU (an event fires once it is in place) or make
        it before returning (None)."""
        if len(src_page_ids) != len(dst_page_ids):
            raise TransferError(f"{len(src_page_ids)} source pages for {len(dst_page_ids)} slots")
        if not src_page_ids:
            return None
        remote = self._remote(endpoint)
        if max(dst_page_ids) >= remote.shape[2] or min(dst_page_ids) < 0:
            raise TransferError(f"destination pages {dst_page_ids} outside the remote pool")
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

    def _remote(self, endpoint: dict[str, Any]) -> torch.Tensor:
        key = endpoint.get("id")
        if key in self._remotes:
            return self._remotes[key][1]
        if endpoint.get("backend") != "ipc" or key is None:
            raise TransferError(f"not an ipc endpoint: {sorted(endpoint)}")
        for gone in [k for k, (known, _) in self._remotes.items() if _endpoint_gone(known)]:
            del self._remotes[gone]
            self._direct_only.discard(gone)
        shape, dtype_name = endpoint["shape"], endpoint["dtype"]
        check_shapes(self.pool, shape, dtype_name)
        if "cuda_ipc" in endpoint and endpoint.get("pid") == os.getpid():
            remote = _SAME_PROCESS_POOLS[key]  # CUDA cannot open its own process's handles
        elif "cuda_ipc" in endpoint:
            remote = decode_cuda_ipc(endpoint["cuda_ipc"], _DTYPES[dtype_name])
        else:
            numel = 1
            for dim in shape:
                numel *= dim
            try:
                remote = torch.from_file(
                    endpoint["shm_path"], shared=True, size=numel, dtype=_DTYPES[dtype_name]
                ).view(shape)
            except (RuntimeError, OSError) as e:
                raise TransferError(
                    f"cannot map the decode pool {endpoint['shm_path']}: {e}"
                ) from e
        if self.use_kernel and remote.device != self.pool.data.device:
            from kvstrata.disagg.transport.ipc_kernel import enable_peer_access

            if not enable_peer_access(self.pool.data.device, remote.device):
                self._direct_only.add(key)
        self._remotes[key] = (endpoint, remote)
        return remote

    def close(self) -> None:
        self._remotes.clear()


# CUDA IPC descriptions travel as JSON (never pickle: a peer must not run code here). The
# fields are those of torch's own reduction of a CUDA tensor for multiprocessing.
_BYTES_FIELDS = ("handle", "ref_counter_handle", "event_handle")


def encode_cuda_ipc(tensor: torch.Tensor) -> dict[str, Any]:
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(tensor)
    (_, size, stride, offset, _, _, device, handle, storage_bytes, storage_offset_bytes, _,
     ref_handle, ref_offset, event_handle, event_sync) = args  # fmt: skip
    fields: dict[str, Any] = {
        "size": list(size), "stride": list(stride), "offset": offset, "device": device,
        "handle": handle, "storage_bytes": storage_bytes,
        "storage_offset_bytes": storage_offset_bytes, "ref_counter_handle": ref_handle,
        "ref_counter_offset": ref_offset, "event_handle": event_handle,
        "event_sync_required": event_sync,
    }  # fmt: skip
    for name in _BYTES_FIELDS:
        fields[name] = base64.b64encode(fields[name] or b"").decode()
    return fields


def decode_cuda_ipc(fields: dict[str, Any], dtype: torch.dtype) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    raw = {name: base64.b64decode(fields[name]) for name in _BYTES_FIELDS}
    return rebuild_cuda_tensor(
        torch.Tensor, torch.Size(fields["size"]), tuple(fields["stride"]), int(fields["offset"]),
        torch.storage.TypedStorage, dtype, int(fields["device"]), raw["handle"],
        int(fields["storage_bytes"]), int(fields["storage_offset_bytes"]), False,
        raw["ref_counter_handle"], int(fields["ref_counter_offset"]), raw["event_handle"] or None,
        bool(fields["event_sync_required"]),
    )  # fmt: skip
