"""Shared-memory L1 pools of the `ipc` transport: a pool left behind by a decode rank
that died without cleanup (SIGKILL) is removed when the next pool is made; live ones stay;
a prefill rank drops its mapping of an ended decode rank's pool."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from kvstrata.disagg.transport.ipc import (
    IpcReceiver,
    IpcSender,
    remove_stale_pools,
    shared_pool_data,
)
from kvstrata.kvcache.pages import KVPool

DIE_HOLDING_A_POOL = """
import os, signal, torch
from kvstrata.disagg.transport.ipc import shared_pool_data
data, path = shared_pool_data((4, 8), torch.float32)
print(path, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # no finalizer runs
"""


def test_a_killed_ranks_pool_is_removed_and_live_pools_stay() -> None:
    done = subprocess.run([sys.executable, "-c", DIE_HOLDING_A_POOL], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    left = Path(done.stdout.strip())
    assert done.returncode == -9 and left.exists(), done.stderr
    live, live_path = shared_pool_data((4, 8), torch.float32)  # cleans up first
    assert not left.exists()
    assert live_path.exists() and live_path not in remove_stale_pools()
    del live


def _decode_pool() -> tuple[KVPool, IpcReceiver]:
    shape = (2, 2, 6, 4, 2, 8)  # layers, K/V, pages, page size, kv heads, head dim
    data, path = shared_pool_data(shape, torch.float32)
    pool = KVPool(6, 4, 2, 2, 8, torch.float32, "cpu", data=data)
    return pool, IpcReceiver(pool, path)


def test_the_sender_drops_mappings_of_ended_decode_ranks() -> None:
    local = KVPool(6, 4, 2, 2, 8, torch.float32, "cpu")
    local.data.copy_(torch.randn(local.data.shape))
    sender = IpcSender(local)
    (pool_a, rank_a), (pool_b, rank_b) = _decode_pool(), _decode_pool()
    sender.write(rank_a.endpoint(), [0, 1], [2, 3])
    sender.write(rank_b.endpoint(), [4], [5])
    assert sender.num_mapped_pools == 2
    assert torch.equal(pool_a.data[:, :, [2, 3]], local.data[:, :, [0, 1]])
    rank_a.close()  # rank A ends: its pool file goes
    pool_c, rank_c = _decode_pool()
    sender.write(rank_c.endpoint(), [1], [0])  # mapping a new pool sweeps the ended ones
    assert sender.num_mapped_pools == 2
    sender.write(rank_b.endpoint(), [2], [1])  # still mapped, still written
    assert torch.equal(pool_b.data[:, :, [5, 1]], local.data[:, :, [4, 2]])
    assert torch.equal(pool_c.data[:, :, 0], local.data[:, :, 1])
    for rank in (rank_b, rank_c):
        rank.close()
