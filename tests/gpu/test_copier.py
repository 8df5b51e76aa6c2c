"""CUDA parity of the Triton zero-copy copier with the torch copier (bf16, scattered
pages, both directions) and an end-to-end load-back through the engine."""

from __future__ import annotations

import random

import pytest
import torch

from kvstrata.kvcache.copier import TorchCopier
from kvstrata.kvcache.host import HostPool
from kvstrata.kvcache.pages import KVPool

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def pools(dtype: torch.dtype) -> tuple[KVPool, HostPool]:
    l1 = KVPool(64, 16, 4, 2, 64, dtype, "cuda")
    l2 = HostPool(48, 16, 4, 2, 64, dtype, pin_memory=True)
    return l1, l2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_copier_matches_torch_copier(dtype: torch.dtype) -> None:
    from kvstrata.kvcache.copier_triton import TritonCopier

    rng = random.Random(0)
    l1, l2 = pools(dtype)
    ref_l1, ref_l2 = pools(dtype)
    l1.data.normal_()
    ref_l1.data.copy_(l1.data)
    l1_pages = rng.sample(range(64), 20)
    l2_pages = rng.sample(range(48), 20)
    TritonCopier(l1, l2).backup(l1_pages, l2_pages)
    TorchCopier(ref_l1, ref_l2).backup(l1_pages, l2_pages)
    assert torch.equal(l2.data, ref_l2.data)

    l1.data.zero_()
    ref_l1.data.zero_()
    back_l1 = rng.sample(range(64), 20)
    TritonCopier(l1, l2).load_back(l2_pages, back_l1)
    TorchCopier(ref_l1, ref_l2).load_back(l2_pages, back_l1)
    torch.cuda.synchronize()
    assert torch.equal(l1.data, ref_l1.data)
    assert l1.data.abs().sum() > 0
