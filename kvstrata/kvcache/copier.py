"""L1 <-> L2 page copies with the layout conversion between them (L1 layer-first,
L2 page-first). `TorchCopier` is the plain path: torch indexing, finished when the call
returns; faster copiers must match it byte for byte."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from kvstrata.kvcache.host_pool import HostPool
from kvstrata.kvcache.pages import KVPool


@dataclass
class CopyStats:
    num_pages: int = 0
    num_bytes: int = 0
    seconds: float = 0.0


class Copier(Protocol):
    """Moves whole pages between the L1 pool and the L2 host pool.

    Ordering contract: neither call stalls the engine's steps. Engine work may read the
    L1 destination pages of a `load_back` only after `fence_loads()` (later work on the
    compute stream then runs after every load-back so far). The L1 source pages of a
    `backup` may be freed only after `fence_l1()` (later engine work then runs after every
    backup so far), and its host pages read or rewritten on the host only after the
    waiter `host_fence()` gave has returned. Copies run in the order they were asked for."""

    backup_stats: CopyStats  # seconds: the host's time to start them
    load_back_stats: CopyStats

    def backup(self, l1_page_ids: list[int], host_page_ids: list[int]) -> None: ...

    def load_back(self, host_page_ids: list[int], l1_page_ids: list[int]) -> None: ...

    def fence_loads(self) -> None: ...

    def fence_l1(self) -> None: ...

    def host_fence(self) -> Callable[[], None]: ...


def _nothing() -> None:
    pass


class TorchCopier:
    """Finished when each call returns: its fences have nothing to wait for."""

    def __init__(self, l1: KVPool, l2: HostPool) -> None:
        self.l1 = l1
        self.l2 = l2
        self.backup_stats = CopyStats()
        self.load_back_stats = CopyStats()

    def fence_loads(self) -> None:
        pass

    def fence_l1(self) -> None:
        pass

    def host_fence(self) -> Callable[[], None]:
        return _nothing

    def backup(self, l1_page_ids: list[int], host_page_ids: list[int]) -> None:
        if not l1_page_ids:
            return
        start_s = time.perf_counter()
        l1_index = torch.tensor(l1_page_ids, device=self.l1.k_cache[0].device)
        host_index = torch.tensor(host_page_ids)
        for layer, (k, v) in enumerate(zip(self.l1.k_cache, self.l1.v_cache)):
            self.l2.data[host_index, layer, 0] = k[l1_index].cpu()
            self.l2.data[host_index, layer, 1] = v[l1_index].cpu()
        _account(self.backup_stats, len(l1_page_ids), self.l2.page_bytes, start_s)

    def load_back(self, host_page_ids: list[int], l1_page_ids: list[int]) -> None:
        if not l1_page_ids:
            return
        start_s = time.perf_counter()
        device = self.l1.k_cache[0].device
        pages = self.l2.data[torch.tensor(host_page_ids)]
        if device.type == "cuda":
            pages = pages.pin_memory().to(device, non_blocking=True)
        l1_index = torch.tensor(l1_page_ids, device=device)
        for layer, (k, v) in enumerate(zip(self.l1.k_cache, self.l1.v_cache)):
            k[l1_index] = pages[:, layer, 0]
            v[l1_index] = pages[:, layer, 1]
        _account(self.load_back_stats, len(l1_page_ids), self.l2.page_bytes, start_s)


def _account(stats: CopyStats, num_pages: int, page_bytes: int, start_s: float) -> None:
    stats.num_pages += num_pages
    stats.num_bytes += num_pages * page_bytes
    stats.seconds += time.perf_counter() - start_s
