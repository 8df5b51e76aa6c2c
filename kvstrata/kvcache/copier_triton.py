"""The fast L1 <-> L2 copier for CUDA: one Triton kernel moves every (page, layer, K/V)
chunk between the layer-first L1 pool and the page-first pinned L2 pool, reading or
writing host memory directly (zero-copy over UVA), so scattered pages cost one launch
instead of a gather plus a copy. Behind the `Copier` seam; parity with `TorchCopier`."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from kvstrata.kvcache.copier import CopyStats, _account, _nothing
from kvstrata.kvcache.host_pool import HostPool
from kvstrata.kvcache.kv_scales import is_fp8
from kvstrata.kvcache.pages import KVPool

BLOCK_ELEMS = 4096
# Programs of one copy. A program waiting on PCIe holds its SM: a copy with one program
# per chunk (thousands) took the SMs of concurrent decode steps (issue 29.1); this many
# still keep enough requests in flight for the link.
MAX_PROGRAMS = 16


@triton.jit
def copy_chunks(
    src,
    dst,
    src_pages,
    dst_pages,
    src_page_stride,
    src_chunk_stride,
    dst_page_stride,
    dst_chunk_stride,
    chunk_elems,
    num_chunks,
    num_blocks,
    num_items,
    BLOCK: tl.constexpr,
):
    # Item w is block b of chunk c (= layer * 2 + k_or_v) of the i-th page pair; the
    # programs take the items in turn, so a copy holds only as many SMs as programs.
    for w in range(tl.program_id(0), num_items, tl.num_programs(0)):
        b = w % num_blocks
        c = ((w // num_blocks) % num_chunks).to(tl.int64)
        i = w // (num_blocks * num_chunks)
        src_page = tl.load(src_pages + i).to(tl.int64)
        dst_page = tl.load(dst_pages + i).to(tl.int64)
        offs = b * BLOCK + tl.arange(0, BLOCK)
        mask = offs < chunk_elems
        x = tl.load(src + src_page * src_page_stride + c * src_chunk_stride + offs, mask=mask)
        tl.store(dst + dst_page * dst_page_stride + c * dst_chunk_stride + offs, x, mask=mask)


def launch_copy(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_index: torch.Tensor,
    dst_index: torch.Tensor,
    src_strides: tuple[int, int],
    dst_strides: tuple[int, int],
    chunk_elems: int,
    num_chunks: int,
    max_programs: int | None = None,
) -> None:
    """Copy chunk c of page src_index[i] to chunk c of page dst_index[i], for every i and
    every c < num_chunks (strides in elements: page, chunk), on at most `max_programs`
    programs (None: one per block of a chunk)."""
    if is_fp8(src.dtype):  # a copy moves bytes: no fp8 conversion path in the kernel
        src, dst = src.view(torch.uint8), dst.view(torch.uint8)
    num_blocks = triton.cdiv(chunk_elems, BLOCK_ELEMS)
    num_items = src_index.numel() * num_chunks * num_blocks
    if num_items == 0:
        return
    num_programs = num_items if max_programs is None else min(num_items, max_programs)
    copy_chunks[(num_programs,)](
        src,
        dst,
        src_index,
        dst_index,
        src_strides[0],
        src_strides[1],
        dst_strides[0],
        dst_strides[1],
        chunk_elems,
        num_chunks,
        num_blocks,
        num_items,
        BLOCK=BLOCK_ELEMS,
    )


class TritonCopier:
    """Copies run on a side stream, in the order asked, after the compute stream's work
    queued so far, and block nobody: `fence_loads` makes the compute stream wait for the
    load-backs (before a batch reads their pages: decode steps of other requests run on
    meanwhile), `fence_l1` for the backups (before their L1 pages are freed), and the
    waiter of `host_fence` blocks a host thread until the backups are done (before an L3
    writer reads their host pages)."""

    def __init__(self, l1: KVPool, l2: HostPool, max_programs: int = MAX_PROGRAMS) -> None:
        if not l1.data.is_cuda or not l2.data.is_pinned():
            raise ValueError("TritonCopier needs a CUDA L1 pool and a pinned L2 pool")
        self.l1 = l1
        self.l2 = l2
        self.device = l1.data.device
        self.max_programs = max_programs  # SMs a copy may hold while decode steps run
        self.stream = torch.cuda.Stream(self.device)
        self.backup_stats = CopyStats()
        self.load_back_stats = CopyStats()
        self._backed_up: torch.cuda.Event | None = None  # fires after the last backup
        self._loaded: torch.cuda.Event | None = None  # after the last load-back not fenced
        num_layers, _, num_l1_pages = l1.data.shape[:3]
        self.chunk_elems = l1.data[0, 0, 0].numel()  # one page of one layer's K (or V)
        self.num_chunks = num_layers * 2
        # L1 [layer, kv, page, chunk]: page stride chunk, chunk stride num_pages * chunk.
        self.l1_strides = (self.chunk_elems, num_l1_pages * self.chunk_elems)
        # L2 [page, layer, kv, chunk]: page stride num_chunks * chunk, chunk stride chunk.
        self.l2_strides = (self.num_chunks * self.chunk_elems, self.chunk_elems)

    def load_back(self, host_page_ids: list[int], l1_page_ids: list[int]) -> None:
        if not l1_page_ids:
            return
        start_s = time.perf_counter()
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)  # the L1 pages may have been freed by queued work
        with torch.cuda.stream(self.stream):
            self._launch(
                self.l2.data,
                self.l1.data,
                host_page_ids,
                l1_page_ids,
                self.l2_strides,
                self.l1_strides,
            )
        event = torch.cuda.Event()
        event.record(self.stream)
        self._loaded = event
        _account(self.load_back_stats, len(l1_page_ids), self.l2.page_bytes, start_s)

    def fence_loads(self) -> None:
        if self._loaded is not None:
            torch.cuda.current_stream(self.device).wait_event(self._loaded)
            self._loaded = None

    def backup(self, l1_page_ids: list[int], host_page_ids: list[int]) -> None:
        if not l1_page_ids:
            return
        start_s = time.perf_counter()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self._launch(
                self.l1.data,
                self.l2.data,
                l1_page_ids,
                host_page_ids,
                self.l1_strides,
                self.l2_strides,
            )
        event = torch.cuda.Event()
        event.record(self.stream)
        self._backed_up = event
        _account(self.backup_stats, len(l1_page_ids), self.l2.page_bytes, start_s)

    def fence_l1(self) -> None:
        if self._backed_up is not None:
            torch.cuda.current_stream(self.device).wait_event(self._backed_up)

    def host_fence(self) -> Callable[[], None]:
        event = self._backed_up
        return event.synchronize if event is not None else _nothing

    def _launch(
        self,
        src: torch.Tensor,
        dst: torch.Tensor,
        src_pages: list[int],
        dst_pages: list[int],
        src_strides: tuple[int, int],
        dst_strides: tuple[int, int],
    ) -> None:
        src_index = torch.tensor(src_pages, dtype=torch.int64).pin_memory()
        dst_index = torch.tensor(dst_pages, dtype=torch.int64).pin_memory()
        src_index = src_index.to(self.device, non_blocking=True)
        dst_index = dst_index.to(self.device, non_blocking=True)
        launch_copy(
            src,
            dst,
            src_index,
            dst_index,
            src_strides,
            dst_strides,
            self.chunk_elems,
            self.num_chunks,
            self.max_programs,
        )
