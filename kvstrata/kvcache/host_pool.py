"""The L2 host-memory page pool: page-first layout, pinned when CUDA is present, each page
one contiguous blob for L3 I/O."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvstrata.kvcache.pages import give_back, zeroed_mapping

if TYPE_CHECKING:
    import mmap


class HostPool:
    """Page-first KV in host memory: `data[page]` is one page of every layer's K and V,
    shape `[num_layers, 2, page_size, num_kv_heads, head_dim]`, contiguous, so a page is
    one blob for L3 I/O (`page_bytes_view`)."""

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        pin_memory: bool,
    ) -> None:
        self.num_pages = num_pages
        shape = (num_pages, num_layers, 2, page_size, num_kv_heads, head_dim)
        self._mapping: mmap.mmap | None = None  # under unpinned storage
        if pin_memory:  # pinned memory is allocated, and resident, whole
            self.data = torch.zeros(shape, dtype=dtype, pin_memory=True)
        else:  # pages become resident as they are written
            self.data, self._mapping = zeroed_mapping(shape, dtype, "cpu")
        self.page_bytes = self.data[0].numel() * self.data.element_size()
        self._bytes = self.data.view(num_pages, -1).view(torch.uint8)

    def release(self) -> None:
        """Give the pool's memory back (as `KVPool.release`); idempotent, and the pool
        holds no pages afterwards."""
        give_back(self._mapping)
        self._mapping = None
        self.data = self.data.new_empty(0)
        self._bytes = self._bytes.new_empty((0, 0))

    def page_bytes_view(self, page_id: int) -> torch.Tensor:
        """Page `page_id` as a 1-D uint8 view (what the L3 backends read into / write from)."""
        return self._bytes[page_id]
