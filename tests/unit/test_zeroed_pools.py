"""KV pools on the CPU take memory as their pages are written, not all at start (issue 27,
item 8: each in-process engine zero-filled a 1 GiB default L1 pool, and the unit tests
alone held 10 GiB): `zeroed` maps them anonymously, reads as zeros, frees with the tensor."""

from __future__ import annotations

from pathlib import Path

import torch

from kvstrata.kvcache.host_pool import HostPool
from kvstrata.kvcache.pages import KVPool

_MIB = 1 << 20


def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096


def test_cpu_pools_are_resident_only_where_written() -> None:
    before = rss_bytes()
    # 256 MiB each: 2 layers x K/V x 8192 pages x 16 tokens x 2 heads x 64 dims x fp32.
    l1 = KVPool(8192, 16, 2, 2, 64, torch.float32, "cpu")
    l2 = HostPool(8192, 16, 2, 2, 64, torch.float32, pin_memory=False)
    assert l1.data.numel() * 4 == l2.data.numel() * 4 == 256 * _MIB
    assert rss_bytes() - before < 32 * _MIB
    l1.k_cache[0][:2048].fill_(1.0)  # a quarter of one layer's K: 16 MiB
    l2.data[:1024].fill_(2.0)  # an eighth of L2: 32 MiB
    grown = rss_bytes() - before
    assert 40 * _MIB <= grown < 96 * _MIB
    # Unwritten pages read as zeros (reading them may map them: checked last).
    assert not l1.k_cache[0][2048:].any() and not l1.v_cache[1].any()
    assert not l2.data[1024:].any() and l2.data[:1024].eq(2.0).all()
    del l1, l2
    assert rss_bytes() - before < 32 * _MIB  # the mappings went with the tensors
