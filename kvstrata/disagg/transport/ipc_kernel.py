"""The CUDA fast path of the `ipc` transport: one Triton launch on the prefill GPU copies
every (page, layer, K/V) chunk of the pages being sent into the decode pool, which may
live on another GPU of the host (stores go over peer access, e.g. NVLink)."""

from __future__ import annotations

import torch

from kvstrata.kvcache.copier_triton import launch_copy


def enable_peer_access(local: torch.device, remote: torch.device) -> bool:
    """Let kernels on `local` read and write `remote`'s memory; False if the GPUs cannot.
    torch enables peer access from a copy's source device to its destination on the first
    cross-device copy, so one element copied into a scratch tensor on `remote` does it (no
    pool is touched)."""
    if not torch.cuda.can_device_access_peer(local, remote):
        return False
    scratch = torch.empty(1, device=remote)
    scratch.copy_(torch.zeros(1, device=local))
    torch.cuda.synchronize(remote)
    return True


def write_pages(
    local: torch.Tensor, remote: torch.Tensor, src_page_ids: list[int], dst_page_ids: list[int]
) -> None:
    """Copy pages `src_page_ids` of the pool `local` into pages `dst_page_ids` of the pool
    `remote`; both [layer, k_or_v, page, ...] with equal trailing dims. Runs on the current
    stream of `local`'s device; returns without waiting for the copy."""
    num_layers, _, num_local_pages = local.shape[:3]
    num_remote_pages = remote.shape[2]
    chunk_elems = local[0, 0, 0].numel()  # one page of one layer's K (or V)
    src_index, dst_index = _index(src_page_ids, local.device), _index(dst_page_ids, local.device)
    launch_copy(
        local,
        remote,
        src_index,
        dst_index,
        (chunk_elems, num_local_pages * chunk_elems),
        (chunk_elems, num_remote_pages * chunk_elems),
        chunk_elems,
        num_layers * 2,
    )


def _index(page_ids: list[int], device: torch.device) -> torch.Tensor:
    index = torch.tensor(page_ids, dtype=torch.int64)
    if device.type == "cuda":
        index = index.pin_memory().to(device, non_blocking=True)
    return index
