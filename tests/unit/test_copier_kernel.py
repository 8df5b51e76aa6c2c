"""The Triton copy kernel's addressing, checked on CPU with Triton's interpreter against
the plain torch copier (the GPU run of the same check is tests/gpu/test_copier.py)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import torch
from kvstrata.kvcache.copier import TorchCopier
from kvstrata.kvcache.copier_triton import launch_copy
from kvstrata.kvcache.host_pool import HostPool
from kvstrata.kvcache.pages import KVPool

L, P1, P2, PS, H, D = 3, 7, 5, 4, 2, 8
l1 = KVPool(P1, PS, L, H, D, torch.float32, "cpu"); l1.data.normal_()
l2 = HostPool(P2, PS, L, H, D, torch.float32, False)
ref_l1 = KVPool(P1, PS, L, H, D, torch.float32, "cpu"); ref_l1.data.copy_(l1.data)
ref_l2 = HostPool(P2, PS, L, H, D, torch.float32, False)
chunk = l1.data[0, 0, 0].numel()
l1_strides, l2_strides = (chunk, P1 * chunk), (2 * L * chunk, chunk)

def launch(src, dst, src_pages, dst_pages, src_strides, dst_strides):
    # 2 programs for 3 pages x 6 chunks: each program takes several items in turn.
    launch_copy(src, dst, torch.tensor(src_pages), torch.tensor(dst_pages),
                src_strides, dst_strides, chunk, 2 * L, max_programs=2)

launch(l1.data, l2.data, [6, 1, 3], [0, 4, 2], l1_strides, l2_strides)
TorchCopier(ref_l1, ref_l2).backup([6, 1, 3], [0, 4, 2])
assert torch.equal(l2.data, ref_l2.data), "backup differs"
l1.data.zero_(); ref_l1.data.zero_()
launch(l2.data, l1.data, [4, 0], [2, 5], l2_strides, l1_strides)
TorchCopier(ref_l1, ref_l2).load_back([4, 0], [2, 5])
assert torch.equal(l1.data, ref_l1.data) and l1.data.abs().sum() > 0, "load-back differs"
print("parity ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_copy_kernel_matches_torch_copier_in_interpreter() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "parity ok" in done.stdout


POOL_TO_POOL = r"""
import torch
from kvstrata.disagg.transport.ipc_kernel import write_pages
from kvstrata.kvcache.pages import KVPool

L, PS, H, D = 3, 4, 2, 8
local = KVPool(7, PS, L, H, D, torch.float32, "cpu"); local.data.normal_()
remote = KVPool(5, PS, L, H, D, torch.float32, "cpu")  # another page count
expected = remote.data.clone()
src, dst = [6, 1, 3], [0, 4, 2]
expected[:, :, dst] = local.data[:, :, src]
write_pages(local.data, remote.data, src, dst)
assert torch.equal(remote.data, expected), "pool-to-pool write differs"
print("parity ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_ipc_write_kernel_matches_torch_indexing_in_interpreter() -> None:
    # The ipc transport's CUDA path: the same kernel between two layer-first pools.
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run(
        [sys.executable, "-c", POOL_TO_POOL], env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "parity ok" in done.stdout
