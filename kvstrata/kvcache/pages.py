"""L1 pages: the free-list allocator (metadata only, so caches and simulators can run
without tensors) and the KV pool (per-layer K/V tensors in layer-first layout); `zeroed`,
the pools' storage, which on the CPU takes memory only as pages are written and gives it
back at once on `release`."""

from __future__ import annotations

import math
import mmap
from collections import Counter, deque
from collections.abc import Iterable

import torch

from kvstrata.kvcache.kv_scales import KVScales, is_fp8


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero tensor. On the CPU it lives in an anonymous mapping, whose pages read as zero
    and become resident only once written: a pool sized for the worst case (1 GiB of L1
    and 2 GiB of L2 by default on CPU) costs the memory of the pages it holds, where
    torch.zeros writes, and so keeps resident, every byte up front."""
    return zeroed_mapping(shape, dtype, device)[0]


def zeroed_mapping(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str
) -> tuple[torch.Tensor, mmap.mmap | None]:
    """`zeroed`, and the anonymous mapping under it (None on a device, or with no
    elements), whose pages `give_back` returns to the system."""
    count = math.prod(shape)
    if torch.device(device).type != "cpu" or count == 0:
        return torch.zeros(shape, dtype=dtype, device=device), None
    num_bytes = count * torch.empty((), dtype=dtype).element_size()
    mapping = mmap.mmap(-1, num_bytes)
    # The tensor keeps the mapping alive (frombuffer holds the buffer) and frees it with it.
    return torch.frombuffer(mapping, dtype=dtype, count=count).view(shape), mapping


def give_back(mapping: mmap.mmap | None) -> None:
    """Drop the resident pages of a `zeroed_mapping` now (MADV_DONTNEED), whoever still
    holds a view of it: they read as zero again and cost nothing until written. Unmapping
    would turn such a view into a crash; this only frees the memory."""
    if mapping is not None and not mapping.closed:
        mapping.madvise(mmap.MADV_DONTNEED)


class OutOfPages(RuntimeError):
    """Raised by `PageAllocator.alloc` when fewer pages are free than asked for."""


class PageAllocator:
    """Hands out page ids from a FIFO free list: ids come out lowest-first on a fresh
    pool and freed ids go to the back, so allocation order is deterministic."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"a page pool needs at least one page, got {num_pages}")
        self.num_total_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._is_free = [True] * num_pages

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    def alloc(self, num_pages: int) -> list[int]:
        if num_pages < 0:
            raise ValueError(f"cannot allocate {num_pages} pages")
        if num_pages > len(self._free):
            raise OutOfPages(f"asked for {num_pages} pages, {len(self._free)} free")
        page_ids = [self._free.popleft() for _ in range(num_pages)]
        for page_id in page_ids:
            self._is_free[page_id] = False
        return page_ids

    def free(self, page_ids: Iterable[int]) -> None:
        page_ids = list(page_ids)
        # Check the whole list first so a bad call frees nothing.
        for page_id in page_ids:
            if not 0 <= page_id < self.num_total_pages:
                raise ValueError(f"page id {page_id} is outside the pool")
            if self._is_free[page_id]:
                raise RuntimeError(f"page {page_id} freed twice")
        if len(set(page_ids)) != len(page_ids):
            raise RuntimeError("the same page appears twice in one free")
        for page_id in page_ids:
            self._is_free[page_id] = True
            self._free.append(page_id)

    def is_free(self, page_id: int) -> bool:
        return self._is_free[page_id]

    def free_among(self, page_ids: Iterable[int]) -> list[int]:
        """The pages of `page_ids` (all in the pool) that are free, sorted."""
        flags = self._is_free
        return sorted(page_id for page_id in page_ids if flags[page_id])

    def reset(self) -> None:
        self._free = deque(range(self.num_total_pages))
        self._is_free = [True] * self.num_total_pages

    def check_integrity(self) -> list[str]:
        """The free list and the free flags agree: every listed page is in the pool, listed
        once and flagged free, and every flagged page is listed. Then free + allocated =
        total holds by construction (allocated = the pages not flagged)."""
        flags, free = self._is_free, self._free
        if (
            len(flags) == self.num_total_pages
            and len(set(free)) == len(free) == flags.count(True)
            and all(0 <= p < len(flags) and flags[p] for p in free)
        ):
            return []  # the common case, checked in one pass: the listed pages are flagged
        violations = []
        if len(flags) != self.num_total_pages:
            violations.append(
                f"page allocator: {len(flags)} free flags for {self.num_total_pages} pages"
            )
        listed = Counter(free)
        twice = sorted(p for p, n in listed.items() if n > 1)
        if twice:
            violations.append(f"page allocator: pages listed free twice: {twice[:10]}")
        outside = sorted(p for p in listed if not 0 <= p < len(flags))
        if outside:
            violations.append(f"page allocator: free pages outside the pool: {outside[:10]}")
        flagged = {p for p, is_free in enumerate(flags) if is_free}
        unflagged = sorted(set(listed) - flagged - set(outside))
        if unflagged:
            violations.append(f"page allocator: listed free but allocated: {unflagged[:10]}")
        unlisted = sorted(flagged - set(listed))
        if unlisted:
            violations.append(f"page allocator: flagged free but not listed: {unlisted[:10]}")
        return violations


class KVPool:
    """K and V tensors for every layer, shape `[num_pages, page_size, num_kv_heads,
    head_dim]` each (layer-first: attention reads one layer at a time). All of them are
    views of one allocation `data[layer, k_or_v]`, so a copy kernel can address any page
    of any layer from one base pointer."""

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        data: torch.Tensor | None = None,
        scales: KVScales | None = None,
    ) -> None:
        """`data`, if given, is the zeroed storage to use (e.g. shared memory that a
        transport exposes to other processes); it must have the shape below. `scales`:
        what a stored value is multiplied by when read, per layer (unit if None; only an
        fp8 pool has others)."""
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_layers = num_layers
        self._page_bytes = KVPool.page_bytes_for(
            page_size, num_layers, num_kv_heads, head_dim, dtype
        )
        shape = (num_layers, 2, num_pages, page_size, num_kv_heads, head_dim)
        self._mapping: mmap.mmap | None = None  # the storage's, when the pool made it
        if data is None:
            data, self._mapping = zeroed_mapping(shape, dtype, device)
        elif tuple(data.shape) != shape or data.dtype != dtype:
            raise ValueError(f"KV pool storage {tuple(data.shape)} {data.dtype} != {shape} {dtype}")
        self.data = data
        self.k_cache = [self.data[layer, 0] for layer in range(num_layers)]
        self.v_cache = [self.data[layer, 1] for layer in range(num_layers)]
        self.scales = scales if scales is not None else KVScales.unit(num_layers)
        if len(self.scales.k) != num_layers:
            raise ValueError(f"{len(self.scales.k)} KV scales for {num_layers} layers")
        if not self.scales.is_unit and not is_fp8(dtype):
            raise ValueError(f"KV scales other than 1.0 need an fp8 pool, not {dtype}")

    def release(self) -> None:
        """Give the pool's memory back; idempotent. Afterwards it holds no pages (its
        tensors are empty) and using it is a bug. Storage the pool made (`zeroed`) is
        freed at once, even where another object still holds a view of it; other storage
        (a device's, a shared-memory file) goes with its last reference: the pool drops its
        own, and the model, copiers and transports read K/V through the pool."""
        give_back(self._mapping)
        self._mapping = None
        self.data = self.data.new_empty(0)
        self.k_cache, self.v_cache = [], []

    @staticmethod
    def page_bytes_for(
        page_size: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Bytes of one page across all layers, K and V."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * page_size * num_kv_heads * head_dim * itemsize

    @property
    def page_bytes(self) -> int:
        return self._page_bytes
