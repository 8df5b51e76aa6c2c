"""Shared-memory L1 pools of the `ipc` transport: a pool left behind by a decode rank
that died without cleanup (SIGKILL) is removed when the next pool is made; live ones stay."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from kvstrata.disagg.transport.ipc import remove_stale_pools, shared_pool_data

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
