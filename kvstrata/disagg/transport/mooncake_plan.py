"""How a `mooncake` write becomes transfers: where each page of each plane (layer, K or V)
of a pool lies in memory, runs of pages consecutive in both pools cut into contiguous
copies of at most 4 MiB (the tcp transport's per-peer queue limit), and the items
(one page of one plane) a coalesced write gathers and scatters."""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_TRANSFER_BYTES = 4 << 20
# On tcp, transfers under ~128 KiB lose bandwidth to per-transfer cost; above it the plain
# plan matched or beat staging + scatter, which pays two copies (docs/results.md, issue
# 17.1): plans whose transfers average less than this are coalesced.
COALESCE_BELOW_BYTES = 128 << 10


@dataclass(frozen=True)
class Transfer:
    """One contiguous copy from this process's pool into a remote one."""

    src_ptr: int
    dst_ptr: int
    num_bytes: int


@dataclass(frozen=True)
class PoolRegion:
    """Where a pool's pages are in memory. A pool is `[num_layers, 2, num_pages, ...]`, so
    in plane (layer, k/v) `q` page `p` is the `chunk_bytes` at
    `base_ptr + (q * num_pages + p) * chunk_bytes`."""

    base_ptr: int
    num_pages: int
    num_planes: int  # num_layers * 2
    chunk_bytes: int  # page_size * num_kv_heads * head_dim * itemsize

    @staticmethod
    def of(data: torch.Tensor) -> PoolRegion:
        """The region of a local pool's storage `data`."""
        num_layers, num_kv, num_pages = data.shape[:3]
        chunk_bytes = data[0, 0, 0].numel() * data.element_size()
        return PoolRegion(data.data_ptr(), num_pages, num_layers * num_kv, chunk_bytes)

    def page_ptr(self, plane: int, page_id: int) -> int:
        return self.base_ptr + (plane * self.num_pages + page_id) * self.chunk_bytes


def page_runs(src_page_ids: list[int], dst_page_ids: list[int]) -> list[list[int]]:
    """[src page, dst page, num_pages] of each run of pages consecutive in both pools."""
    runs: list[list[int]] = []
    for src_page, dst_page in sorted(zip(src_page_ids, dst_page_ids)):
        last = runs[-1] if runs else None
        if last and src_page == last[0] + last[2] and dst_page == last[1] + last[2]:
            last[2] += 1
        else:
            runs.append([src_page, dst_page, 1])
    return runs


def plan_transfers(
    src: PoolRegion, dst: PoolRegion, src_page_ids: list[int], dst_page_ids: list[int]
) -> list[Transfer]:
    """Transfers copying pages `src_page_ids` of `src` into pages `dst_page_ids` of `dst`
    in every plane. Pages consecutive in both pools form one run, cut into transfers of
    at most MAX_TRANSFER_BYTES."""
    assert (src.num_planes, src.chunk_bytes) == (dst.num_planes, dst.chunk_bytes)
    runs = page_runs(src_page_ids, dst_page_ids)
    transfers = []
    for plane in range(src.num_planes):
        for src_page, dst_page, num_pages in runs:
            src_ptr, dst_ptr = src.page_ptr(plane, src_page), dst.page_ptr(plane, dst_page)
            run_bytes = num_pages * src.chunk_bytes
            for offset in range(0, run_bytes, MAX_TRANSFER_BYTES):
                num_bytes = min(MAX_TRANSFER_BYTES, run_bytes - offset)
                transfers.append(Transfer(src_ptr + offset, dst_ptr + offset, num_bytes))
    return transfers


def worth_coalescing(chunk_bytes: int, src_page_ids: list[int], dst_page_ids: list[int]) -> bool:
    """Whether `plan_transfers` would make transfers averaging under COALESCE_BELOW_BYTES
    (the same in every plane, so one plane is counted)."""
    runs = page_runs(src_page_ids, dst_page_ids)
    num_transfers = sum(-(-n * chunk_bytes // MAX_TRANSFER_BYTES) for _, _, n in runs)
    return len(src_page_ids) * chunk_bytes < COALESCE_BELOW_BYTES * num_transfers


def plan_items(
    src: PoolRegion, dst: PoolRegion, src_page_ids: list[int], dst_page_ids: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Item ids (`plane * num_pages + page`, int64) of a write in both pools, plane-major:
    item i of the source goes to item i of the destination."""
    planes = torch.arange(src.num_planes, dtype=torch.int64)[:, None]
    src_pages = torch.tensor(src_page_ids, dtype=torch.int64)[None, :]
    dst_pages = torch.tensor(dst_page_ids, dtype=torch.int64)[None, :]
    return (
        (planes * src.num_pages + src_pages).flatten(),
        (planes * dst.num_pages + dst_pages).flatten(),
    )
